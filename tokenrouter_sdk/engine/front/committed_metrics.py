"""Committed-token metrics computed from a call's events (`Admitted`, `Committed`, `Hopped`,
`Finished`, `StepDone` of `tokenrouter_sdk.engine.messages`); times are
``time.perf_counter()`` seconds. Throughput counts committed tokens only: tokens a policy
discarded on a handoff never count.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from ..messages import Admitted, Committed, Finished, Hopped, Resampled, Retokenized, StepDone


@dataclass
class ModelMetrics:
    """Per-model numbers over the run window.

    Attributes:
        steps: forward steps.
        busy_fraction: time inside steps / run wall time.
        forward_fraction: time inside the model forward / time inside steps (1 - overhead).
        mean_step_s: mean step time, seconds.
        tokens_fed: tokens fed (prefill + decode + extend) over all steps.
        committed_tokens: committed output tokens this model wrote.
        batch_size_hist: batch size -> number of steps.
        preemptions: KV evictions (recomputed later).
        kv_blocks_peak: most KV blocks in use after a step; kv_blocks_mean: their mean.
        kv_pending_blocks_peak: most blocks held by requests pending on this model (handed
            off, KV kept), after a step.
        prefix_hit_tokens: tokens taken from the prefix cache instead of being fed;
            prefix_query_tokens: tokens requests brought when they arrived with no KV here (the
            prompt, or prompt + output so far on a first visit; counted with the cache off too),
            so ``prefix_query_tokens - prefix_hit_tokens`` were prefilled; prefix_hit_rate: their
            ratio (0.0 without arrivals).
        kv_cached_blocks: blocks in the prefix cache after the last step.
        committed_chars: characters this model wrote (models that do not share a tokenizer).
    """

    steps: int = 0
    busy_fraction: float = 0.0
    forward_fraction: float = 0.0
    mean_step_s: float = 0.0
    tokens_fed: int = 0
    committed_tokens: int = 0
    batch_size_hist: dict = field(default_factory=dict)
    preemptions: int = 0
    kv_blocks_peak: int = 0
    kv_blocks_mean: float = 0.0
    kv_pending_blocks_peak: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_rate: float = 0.0
    kv_cached_blocks: int = 0
    committed_chars: int = 0


@dataclass
class Metrics:
    """Run-level metrics. Units are in the field names (``_s`` seconds, ``_tok_s`` tokens/s).

    Attributes:
        requests: requests in the run; failed: of which ended ``failed`` or ``aborted``.
        committed_tokens: committed output tokens (tokens).
        wall_s: first admission to last finish (seconds).
        throughput_tok_s: committed tokens / wall_s.
        mean_latency_s, p50_latency_s, p90_latency_s: admission to finish, per request.
        mean_ttft_s: admission to first committed token.
        per_user_tok_s: mean over requests of committed tokens / (finish - first token).
        hops: handoffs, in both directions (small to large and back count one each),
            including handoffs after which the target committed nothing (it handed the request
            on or back at once, discarding its token); hop_rate: hops / committed tokens (it
            can exceed 1 when requests hop more often than they commit).
        writer_changes: positions whose committed token was written by another model than
            the one before it, summed over requests (at most ``hops``: a handoff that commits
            nothing changes no writer); writer_change_rate: writer_changes / committed tokens.
        large_fraction: committed tokens written by the largest model / committed tokens.
        discarded_tokens: sampled tokens dropped on handoffs and resamples.
        preemptions: KV evictions over all models.
        per_model: name -> `ModelMetrics`.

    Models that do not share a tokenizer (0 otherwise; docs/mixed-vocabularies.md):
    ``committed_tokens`` then counts each writer's own tokens, and the one-unit numbers are:
        committed_chars: characters of the committed text; throughput_chars_s: per second;
            large_fraction_chars: characters written by the largest model / all.
        large_tokens: the committed text's length in the largest model's tokens (summed over
            requests; a request's count as it ended); throughput_large_tok_s: per second;
            large_fraction_large_tok: tokens the largest model wrote / ``large_tokens`` (at most
            1); hop_rate_large_tok: hops per large-model token.
        retokenized: handoffs received with the text re-encoded (`Retokenized` events);
            refed_per_hop_mean, refed_per_hop_max: tokens a receiving model had in KV and fed
            again because their encoding changed with the new text; fed_per_hop_mean: tokens
            fed on receiving (the re-fed and the new text's); context_per_hop_mean: tokens of
            prompt + output the receiver holds, what re-feeding the whole context would cost.
    """

    requests: int = 0
    failed: int = 0
    committed_tokens: int = 0
    wall_s: float = 0.0
    throughput_tok_s: float = 0.0
    mean_latency_s: float = 0.0
    p50_latency_s: float = 0.0
    p90_latency_s: float = 0.0
    mean_ttft_s: float = 0.0
    per_user_tok_s: float = 0.0
    hops: int = 0
    hop_rate: float = 0.0
    writer_changes: int = 0
    writer_change_rate: float = 0.0
    large_fraction: float = 0.0
    discarded_tokens: int = 0
    preemptions: int = 0
    per_model: dict = field(default_factory=dict)
    committed_chars: int = 0
    throughput_chars_s: float = 0.0
    large_fraction_chars: float = 0.0
    large_tokens: int = 0
    throughput_large_tok_s: float = 0.0
    large_fraction_large_tok: float = 0.0
    hop_rate_large_tok: float = 0.0
    retokenized: int = 0
    refed_per_hop_mean: float = 0.0
    refed_per_hop_max: int = 0
    fed_per_hop_mean: float = 0.0
    context_per_hop_mean: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def _rows(self) -> list[tuple[str, object]]:
        """The run-level numbers (the ones of models without one shared tokenizer only when
        there were such)."""
        shown = self.committed_chars or self.retokenized
        return [(k, v) for k, v in asdict(self).items() if k != "per_model" and (shown or k not in MIXED_FIELDS)]

    def table(self) -> str:
        """A plain-text table of the run-level numbers and one line per model."""
        rows = self._rows()
        lines = [f"{k:<20} {v:.4g}" if isinstance(v, float) else f"{k:<20} {v}" for k, v in rows]
        for name, m in self.per_model.items():
            lines.append(
                f"[{name}] steps={m.steps} busy={m.busy_fraction:.2f} fwd_frac={m.forward_fraction:.2f} "
                f"step={m.mean_step_s * 1e3:.1f}ms committed={m.committed_tokens} fed={m.tokens_fed} "
                f"prefix_hit={m.prefix_hit_rate:.2f} batch_hist={dict(sorted(m.batch_size_hist.items()))}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Metrics of {self.requests} requests (_s: seconds, _tok_s: tokens/s)\n{self.table()}"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))

    def _repr_html_(self) -> str:
        """Two tables: the run-level numbers, and one row per model."""
        from ...tables import html_table

        run = html_table(
            ("metric", "value"),
            self._rows(),
            caption=f"Metrics of {self.requests} requests (_s: seconds, _tok_s: tokens/s)",
        )
        if not self.per_model:
            return run
        cols = (
            "model",
            "steps",
            "busy_fraction",
            "forward_fraction",
            "mean_step_ms",
            "tokens_fed",
            "committed_tokens",
            "preemptions",
            "prefix_hit_rate",
            "batch sizes (size×steps)",
        )
        rows = [
            (
                n,
                m.steps,
                m.busy_fraction,
                m.forward_fraction,
                m.mean_step_s * 1e3,
                m.tokens_fed,
                m.committed_tokens,
                m.preemptions,
                m.prefix_hit_rate,
                ", ".join(f"{b}×{c}" for b, c in sorted(m.batch_size_hist.items())),
            )
            for n, m in self.per_model.items()
        ]
        return run + html_table(cols, rows, caption="per model")


MIXED_FIELDS = frozenset(
    {
        "committed_chars",
        "throughput_chars_s",
        "large_fraction_chars",
        "large_tokens",
        "throughput_large_tok_s",
        "large_fraction_large_tok",
        "hop_rate_large_tok",
        "retokenized",
        "refed_per_hop_mean",
        "refed_per_hop_max",
        "fed_per_hop_mean",
        "context_per_hop_mean",
    }
)
"""The `Metrics` fields of models that do not share a tokenizer."""


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def compute_metrics(trace: list, rids: set[int] | None, models: list[str]) -> Metrics:
    """Metrics of the requests ``rids`` (None = all) over their window in ``trace`` (a list of
    events, e.g. `Call.events`). Cost: O(len(trace)).

    ``models`` is ordered smallest first; the last one is "large" for ``large_fraction``.
    """
    admit, first, end, n_tok, failed = {}, {}, {}, Counter(), 0
    per_model_tok, hops, discarded, writer, changes = Counter(), 0, 0, {}, 0
    chars, units, retok = Counter(), {}, []
    steps_all = []
    for ev in trace:
        if isinstance(ev, StepDone):
            steps_all.append(ev)
            continue
        if rids is not None and ev.rid not in rids:
            continue
        if isinstance(ev, Admitted):
            admit[ev.rid] = ev.t
        elif isinstance(ev, Committed):
            first.setdefault(ev.rid, ev.t)
            n_tok[ev.rid] += len(ev.tokens)
            per_model_tok[ev.model] += len(ev.tokens)
            if ev.tokens:
                changes += writer.get(ev.rid, ev.model) != ev.model
                writer[ev.rid] = ev.model
            if ev.chars is not None:
                chars[ev.model] += ev.chars
            if ev.units is not None:
                units[ev.rid] = ev.units
        elif isinstance(ev, Retokenized):
            retok.append(ev)
        elif isinstance(ev, Hopped):
            hops += 1
            discarded += 0 if ev.kept else 1
        elif isinstance(ev, Resampled):
            discarded += 1
        elif isinstance(ev, Finished):
            end[ev.rid] = ev.t
            failed += ev.reason in ("failed", "aborted")
    m = Metrics(requests=len(admit), failed=failed)
    if not admit:
        return m
    t0 = min(admit.values())
    t1 = max(end.values()) if end else t0
    m.committed_tokens = sum(n_tok.values())
    m.wall_s = t1 - t0
    m.throughput_tok_s = m.committed_tokens / m.wall_s if m.wall_s > 0 else 0.0
    lat = [end[r] - admit[r] for r in end if r in admit]
    m.mean_latency_s = statistics.fmean(lat) if lat else 0.0
    m.p50_latency_s, m.p90_latency_s = _pct(lat, 0.5), _pct(lat, 0.9)
    ttft = [first[r] - admit[r] for r in first if r in admit]
    m.mean_ttft_s = statistics.fmean(ttft) if ttft else 0.0
    speeds = [(n_tok[r] - 1) / (end[r] - first[r]) for r in first if r in end and end[r] > first[r] and n_tok[r] > 1]
    m.per_user_tok_s = statistics.fmean(speeds) if speeds else 0.0
    m.hops, m.discarded_tokens = hops, discarded
    m.hop_rate = hops / m.committed_tokens if m.committed_tokens else 0.0
    m.writer_changes = changes
    m.writer_change_rate = changes / m.committed_tokens if m.committed_tokens else 0.0
    m.large_fraction = per_model_tok[models[-1]] / m.committed_tokens if m.committed_tokens else 0.0
    m.committed_chars = sum(chars.values())
    m.throughput_chars_s = m.committed_chars / m.wall_s if m.wall_s > 0 else 0.0
    m.large_fraction_chars = chars[models[-1]] / m.committed_chars if m.committed_chars else 0.0
    m.large_tokens = sum(units.values())
    m.throughput_large_tok_s = m.large_tokens / m.wall_s if m.wall_s > 0 else 0.0
    m.large_fraction_large_tok = min(1.0, per_model_tok[models[-1]] / m.large_tokens) if m.large_tokens else 0.0
    m.hop_rate_large_tok = hops / m.large_tokens if m.large_tokens else 0.0
    if retok:
        m.retokenized = len(retok)
        m.refed_per_hop_mean = statistics.fmean(e.refed for e in retok)
        m.refed_per_hop_max = max(e.refed for e in retok)
        m.fed_per_hop_mean = statistics.fmean(e.fed for e in retok)
        m.context_per_hop_mean = statistics.fmean(e.context for e in retok)
    steps = defaultdict(list)
    for s in steps_all:
        if t0 <= s.t_start <= t1:
            steps[s.model].append(s)
    for name in models:
        model_steps = steps.get(name, [])
        busy = sum(s.t_end - s.t_start for s in model_steps)
        fwd = sum(s.forward_s for s in model_steps)
        m.per_model[name] = ModelMetrics(
            steps=len(model_steps),
            busy_fraction=busy / m.wall_s if m.wall_s > 0 else 0.0,
            forward_fraction=fwd / busy if busy > 0 else 0.0,
            mean_step_s=busy / len(model_steps) if model_steps else 0.0,
            tokens_fed=sum(s.tokens_fed for s in model_steps),
            committed_tokens=per_model_tok[name],
            batch_size_hist=dict(Counter(s.batch_size for s in model_steps)),
            preemptions=sum(s.preempted for s in model_steps),
            kv_blocks_peak=max((s.kv_used_blocks for s in model_steps), default=0),
            kv_blocks_mean=statistics.fmean(s.kv_used_blocks for s in model_steps) if model_steps else 0.0,
            kv_pending_blocks_peak=max((s.kv_pending_blocks for s in model_steps), default=0),
            prefix_hit_tokens=sum(s.cache_hit_tokens for s in model_steps),
            prefix_query_tokens=sum(s.cache_query_tokens for s in model_steps),
            kv_cached_blocks=model_steps[-1].kv_cached_blocks if model_steps else 0,
            committed_chars=chars[name],
        )
        pm = m.per_model[name]
        pm.prefix_hit_rate = pm.prefix_hit_tokens / pm.prefix_query_tokens if pm.prefix_query_tokens else 0.0
        m.preemptions += m.per_model[name].preemptions
    return m
