"""Incremental reading of the engine's event trace for the views (live and static).

`TraceState.feed` consumes trace events (the `tokenrouter_sdk.engine.messages` events of a call)
one batch at a time, so the live view only reads what is new; the static views feed a finished
run's whole trace at once. It keeps, per request, who owned it when (and where it was pending),
per model the batch size and queue length at each step, and the running totals behind the
stats line. Times are ``time.perf_counter`` seconds; the views show them relative to ``t0``
(the first admission).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..engine.messages import Admitted, Committed, Finished, Hopped, StepDone


@dataclass
class RequestTrack:
    """One request's ownership history.

    Attributes:
        rid: request id.
        t_admit: admission time (s).
        segments: ``[[owner, t_start], ...]``: owner from ``t_start`` until the next segment's
            start (or ``t_end``); ``owner`` is None until the trace names the entry model.
        seen: models that hold KV for the request (visited it).
        t_end: end time (s) or None while running.
        reason: finish reason or None.
        committed: committed tokens so far; hops: handoffs so far.
    """

    rid: int
    t_admit: float
    segments: list = field(default_factory=list)
    seen: set = field(default_factory=set)
    t_end: float | None = None
    reason: str | None = None
    committed: int = 0
    hops: int = 0

    @property
    def owner(self) -> str | None:
        return self.segments[-1][0] if self.segments else None

    def _set_owner_if_unknown(self, model: str) -> None:
        if self.segments and self.segments[-1][0] is None:
            self.segments[-1][0] = model
            self.seen.add(model)


@dataclass
class ModelSeries:
    """Per-model step series: at each step start ``t`` (s), the batch size (requests in the step)
    and the queue length (requests this model owns that are not in the step)."""

    t: list = field(default_factory=list)
    batch: list = field(default_factory=list)
    queue: list = field(default_factory=list)
    busy_s: float = 0.0


class TraceState:
    """The views' running summary of a trace.

    Args:
        models: model names, smallest first (the last is "large" for the large fraction).
        rids: only these requests (None: every request in the trace).
        entries: rid -> entry model (the engine's ``RequestHandle.entry``); without it a
            request's owner is unknown until its first step, commit or hop names it, and it
            counts towards the first model's queue meanwhile.
        labels: rid -> the number a view shows for the request (``RequestOutput.index``: its
            position in the call); default the rid.

    Feed events with `feed`; read `tracks`, `series`, `stats`.
    """

    def __init__(self, models: list[str], rids=None, entries: dict | None = None, labels: dict | None = None):
        self.models = list(models)
        self.entries = dict(entries or {})
        self.labels = dict(labels or {})
        self.rids = None if rids is None else set(rids)
        self.tracks: dict[int, RequestTrack] = {}
        self.series: dict[str, ModelSeries] = {m: ModelSeries() for m in self.models}
        self.tokens_by_model: Counter = Counter()
        self.hops = 0
        self.discarded = 0
        self.t0: float | None = None
        self.t_last: float | None = None
        self.events = 0
        self.prefix_hit = 0  # tokens taken from the prefix caches in this run's steps
        self.prefix_query = 0  # tokens requests brought on arrival at a model

    # -- feeding ------------------------------------------------------------------------------
    def feed(self, events) -> None:
        """Consume trace events in order (any iterable of events)."""
        for ev in events:
            self.events += 1
            if isinstance(ev, StepDone):
                self._step(ev)
                continue
            rid = getattr(ev, "rid", None)
            if rid is None or (self.rids is not None and rid not in self.rids):
                continue
            if isinstance(ev, Admitted):
                t = ev.t
                entry = self.entries.get(rid) or ev.model
                self.tracks[rid] = RequestTrack(rid, t, [[entry, t]], {entry} if entry else set())
                self.t0 = t if self.t0 is None else min(self.t0, t)
                self._touch(t)
                continue
            tr = self.tracks.get(rid)
            if tr is None:
                continue
            if isinstance(ev, Committed):
                n = len(ev.tokens)
                tr._set_owner_if_unknown(ev.model)
                tr.committed += n
                self.tokens_by_model[ev.model] += n
                self._touch(ev.t)
            elif isinstance(ev, Hopped):
                tr._set_owner_if_unknown(ev.src)
                tr.segments.append([ev.dst, ev.t])
                tr.seen.add(ev.dst)
                tr.hops += 1
                self.hops += 1
                self.discarded += 0 if ev.kept else 1
                self._touch(ev.t)
            elif isinstance(ev, Finished):
                tr.reason, tr.t_end = ev.reason, ev.t
                self._touch(ev.t)

    def _touch(self, t: float) -> None:
        self.t_last = t if self.t_last is None else max(self.t_last, t)

    def _step(self, s) -> None:
        if self.t0 is None or s.t_start < self.t0:
            return  # a step of an earlier run
        fed = [r for r in s.fed if r in self.tracks]
        if self.rids is not None and not fed and s.fed:
            return  # another call's requests
        for r in fed:
            self.tracks[r]._set_owner_if_unknown(s.model)
        ser = self.series.setdefault(s.model, ModelSeries())
        first = self.models[0]
        owned = sum(1 for tr in self.tracks.values() if tr.t_end is None and (tr.owner or first) == s.model)
        ser.t.append(s.t_start)
        ser.batch.append(s.batch_size)
        ser.queue.append(max(0, owned - s.batch_size))
        ser.busy_s += s.t_end - s.t_start
        self.prefix_hit += s.cache_hit_tokens
        self.prefix_query += s.cache_query_tokens
        self._touch(s.t_end)

    # -- reading ------------------------------------------------------------------------------
    @property
    def committed(self) -> int:
        return sum(self.tokens_by_model.values())

    @property
    def finished(self) -> int:
        return sum(1 for tr in self.tracks.values() if tr.t_end is not None)

    def stats(self, now: float | None = None) -> dict:
        """The stats line: ``tok_s`` (committed tokens/s since the first admission), ``hop_rate``
        (hops per committed token), ``large_fraction`` (committed tokens by the last model /
        all), ``committed`` (tokens), ``hops``, ``discarded`` (tokens), ``finished`` and
        ``requests`` (counts), ``elapsed_s`` (s), ``prefix_hit_rate`` (tokens taken from the
        prefix caches / tokens requests brought on arrival at a model, over all models).
        ``now``: the clock for a running view (default: the last event's time)."""
        n = self.committed
        t1 = now if now is not None else self.t_last
        el = (t1 - self.t0) if (self.t0 is not None and t1 is not None) else 0.0
        return dict(
            tok_s=n / el if el > 0 else 0.0,
            hop_rate=self.hops / n if n else 0.0,
            large_fraction=self.tokens_by_model[self.models[-1]] / n if n else 0.0,
            committed=n,
            hops=self.hops,
            discarded=self.discarded,
            finished=self.finished,
            requests=len(self.tracks),
            elapsed_s=el,
            prefix_hit_rate=self.prefix_hit / self.prefix_query if self.prefix_query else 0.0,
        )

    def bars(self, now: float | None = None) -> dict:
        """Timeline bars relative to ``t0``: ``{("own", model) | ("pending", model): (ys, bases,
        widths, texts)}``, one entry per model and kind; ``ys`` are row labels ``"req <label>"``
        (the request's ``labels`` entry, else its rid), in request order.
        A running request's last bar ends at ``now`` (default: the last event's time)."""
        out = {(k, m): ([], [], [], []) for k in ("own", "pending") for m in self.models}
        if self.t0 is None:
            return out
        t_now = now if now is not None else (self.t_last or self.t0)
        for tr in sorted(self.tracks.values(), key=lambda x: x.rid):
            end = tr.t_end if tr.t_end is not None else t_now
            seen: set = set()
            for i, (owner, t) in enumerate(tr.segments):
                t_next = tr.segments[i + 1][1] if i + 1 < len(tr.segments) else end
                owner = owner or self.models[0]
                seen.add(owner)
                if t_next <= t and i + 1 < len(tr.segments):
                    continue
                w = max(t_next - t, 0.0)
                name = self.labels.get(tr.rid, tr.rid)
                y = f"req {name}"
                key = ("own", owner) if ("own", owner) in out else None
                if key is not None:
                    ys, bs, ws, txt = out[key]
                    ys.append(y), bs.append(t - self.t0), ws.append(w)
                    txt.append(f"req {name}: {owner} writes ({w:.2f} s)")
                for p in sorted(seen - {owner}):
                    if ("pending", p) in out:
                        ys, bs, ws, txt = out[("pending", p)]
                        ys.append(y), bs.append(t - self.t0), ws.append(w)
                        txt.append(f"req {name}: pending on {p} (KV kept)")
        return out
