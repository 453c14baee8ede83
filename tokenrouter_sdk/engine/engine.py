"""The engine: admission, per-request output assembly, streams and the event trace.

It starts one `SubServer` per model (through a transport), sends each new request to its
entry model, and turns the sub-servers' events (`Committed`, `Hopped`, `Finished`,
`StepDone`) into `RequestOutput`s. Every event is appended to ``trace`` with its time, which
is all `metrics` needs.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from ..policy import Policy
from ..request import RequestConfig, RequestOutput, RequestView, SamplingParams
from . import messages as M
from .subserver import MODES, RegisterPolicy
from .transport import ThreadTransport


class RequestHandle:
    """An admitted (or queued) request: its growing output and a done event."""

    def __init__(self, config: RequestConfig, prompt, entry: str):
        self.config, self.entry = config, entry
        self.output = RequestOutput(rid=config.rid, prompt=prompt)
        self.t_submit = 0.0
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.trace_start = 0  # length of the engine trace before this request was submitted
        self.done = threading.Event()
        self.listeners: list[Callable[[str, object], None]] = []

    @property
    def rid(self) -> int:
        return self.config.rid


class Engine:
    """Runs requests across per-model sub-servers.

    Args:
        runners: model name -> runner (smallest model first).
        tokenizer: the shared tokenizer (decoding outputs, stop strings, EOS ids).
        max_concurrency: requests in flight at most; more wait in a FIFO queue (None = no limit).
        max_batch_tokens, max_batch_size: per-step scheduler limits of every sub-server.
        mode: ``"async"`` (default: each model steps whenever it has ready requests),
            ``"delayed"`` (async + per-model thresholds), ``"sync"`` (global step barrier: every
            model finishes its step before any starts the next, as the official R2R/CITER code
            runs), ``"model_sync"`` (one model at a time, round robin).
        thresholds: delayed batching thresholds B_i per model name (``delayed`` mode; missing
            models get 1). Feasibility sum_i (B_i - 1) < N is checked per run (`check_thresholds`).
        retain_kv: False frees a request's KV on every handoff (re-prefill on return).
        transport: how sub-servers run and talk: `ThreadTransport` (default) or `SimTransport`
            (simulated time, for the sim backend).

    Raises:
        ValueError: unknown mode, or thresholds < 1 / naming unknown models.
    """

    def __init__(self, runners: dict, tokenizer, *, max_concurrency: int | None = None,
                 max_batch_tokens: int = 4096, max_batch_size: int = 256, mode: str = "async",
                 thresholds: dict[str, int] | None = None, retain_kv: bool = True, transport=None):
        self.models = list(runners)
        self.runners = dict(runners)
        self.tokenizer = tokenizer
        self.max_concurrency = max_concurrency
        self.trace: list = []
        self._lock = threading.RLock()
        self._reqs: dict[int, RequestHandle] = {}
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._inflight = 0
        self._next_rid = 0
        self._policies: dict[int, Policy] = {}
        self._closed = False
        self._stats: dict[int, dict] = {}
        self._stats_cv = threading.Condition(self._lock)
        self._next_token = 0
        if mode not in MODES:
            raise ValueError(f"unknown schedule mode {mode!r}; choose one of {MODES}")
        self.mode, self.retain_kv = mode, retain_kv
        self.thresholds = self._valid_thresholds(thresholds)
        self._round, self._awaiting, self._rr = 0, set(), 0
        self.transport = transport if transport is not None else ThreadTransport()
        self.clock = self.transport.clock
        specs = {name: dict(name=name, models=self.models, runner=r, tokenizer=tokenizer,
                            max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size, mode=mode,
                            thresholds=self.thresholds, retain_kv=retain_kv) for name, r in runners.items()}
        self.transport.start(specs, self._handle_event)
        self.subservers = getattr(self.transport, "subservers", {})  # in-process transports only

    # -- submission -----------------------------------------------------------------------
    def register_policy(self, policy: Policy, refresh: bool = False) -> int:
        """The key of ``policy`` in every sub-server; sends it on first use, and again with
        ``refresh`` (a policy edited between calls reaches sub-server processes)."""
        with self._lock:
            key = next((k for k, p in self._policies.items() if p is policy), None)
            if key is not None and not refresh:
                return key
            if key is None:
                key = len(self._policies)
                self._policies[key] = policy
        for name in self.models:
            self.transport.send(name, RegisterPolicy(key, policy))
        return key

    def submit(self, prompt_ids: list[int] | None, params: SamplingParams, policy: Policy, prompt=None,
               error: str | None = None) -> RequestHandle:
        """Queue one request; returns its handle at once. A request with ``error`` set (bad
        input found by the caller) ends ``failed`` with that error without running."""
        if self._closed:
            raise RuntimeError("this Router is closed; create a new one")
        key = self.register_policy(policy)
        eos = self.tokenizer.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        with self._lock:
            rid = self._next_rid
            self._next_rid += 1
        cfg = RequestConfig(rid, list(prompt_ids or []), params, key, eos_ids)
        entry = self.models[0]
        state: dict = {}
        if error is None:
            try:
                e = policy.entry(RequestView(rid, cfg.prompt_ids, [], "", state, 0, tuple(self.models)), self.models)
                if e is not None:
                    if e not in self.models:
                        raise ValueError(f"returned {e!r}; expected one of {self.models}")
                    entry = e
            except Exception as ex:  # noqa: BLE001
                error = f"policy {policy!r}.entry failed: {type(ex).__name__}: {ex}"
        h = RequestHandle(cfg, prompt, entry)
        h.t_submit, h.state = self.clock(), state
        with self._lock:
            self._reqs[rid] = h
            if error is not None:
                self.trace.append(("admit", rid, self.clock()))
                self._end(h, "failed", error, self.clock())
                return h
            self._queue.append(h)
            self._admit_more()
        return h

    def _valid_thresholds(self, thresholds: dict | None) -> dict[str, int]:
        thresholds = dict(thresholds or {})
        bad = {k: v for k, v in thresholds.items() if k not in self.models or int(v) < 1}
        if bad:
            raise ValueError(f"thresholds {bad} invalid: each must name a model of {self.models} and be >= 1")
        return {m: int(thresholds.get(m, 1)) for m in self.models}

    def set_thresholds(self, thresholds: dict[str, int]) -> None:
        """Change the delayed batching thresholds B_i (models not named keep theirs)."""
        new = self._valid_thresholds({**self.thresholds, **thresholds})
        with self._lock:
            self.thresholds = new
        for name in self.models:
            self.transport.send(name, M.SetThresholds(new))

    def check_thresholds(self, n: int) -> None:
        """Raise ValueError unless sum_i (B_i - 1) < n (TokenRouter paper, appendix: with fewer
        requests in flight, every model can wait below its threshold forever)."""
        if self.mode != "delayed":
            return
        slack = sum(b - 1 for b in self.thresholds.values())
        if slack >= n:
            raise ValueError(f"delayed batching thresholds {self.thresholds} need sum(B_i - 1) = {slack} < N, "
                             f"but N = {n} requests are in flight; lower a threshold or raise concurrency "
                             f"to at least {slack + 1}")

    def _admit_more(self) -> None:
        admitted = False
        while self._queue and (self.max_concurrency is None or self._inflight < self.max_concurrency):
            h = self._queue.popleft()
            h.t_admit = self.clock()
            self._inflight += 1
            admitted = True
            self.trace.append(("admit", h.rid, h.t_admit))
            if self.mode == "delayed":
                self._broadcast_inflight()
            self.transport.send(h.entry, M.Admit(h.config, h.t_admit, h.state))
        if admitted:
            self._kick()

    def _broadcast_inflight(self) -> None:
        for name in self.models:
            self.transport.send(name, M.SetInflight(self._inflight))

    def _kick(self) -> None:
        """Gated modes: start the next round if none is running and work is in flight."""
        if self.mode not in ("sync", "model_sync") or self._awaiting or self._inflight == 0 or self._closed:
            return
        self._round += 1
        if self.mode == "sync":
            targets = list(self.models)
        else:
            targets = [self.models[self._rr % len(self.models)]]
            self._rr += 1
        self._awaiting = set(targets)
        for name in targets:
            self.transport.send(name, M.Go(self._round))

    def _round_done(self, model: str, rnd: int | None) -> None:
        if rnd is not None and rnd == self._round:
            self._awaiting.discard(model)
            if not self._awaiting:
                self._kick()

    def abort(self, rid: int, reason: str = "aborted by the user") -> None:
        with self._lock:
            h = self._reqs.get(rid)
            if h is None or h.done.is_set():
                return
            if h in self._queue:
                self._queue.remove(h)
                self._end(h, "aborted", reason, self.clock())
                return
        for name in self.models:
            self.transport.send(name, M.Abort(rid, reason))

    # -- events ---------------------------------------------------------------------------
    def _handle_event(self, ev) -> None:
        with self._lock:
            self._on_event(ev)

    def _on_event(self, ev) -> None:
        if isinstance(ev, M.StepDone):
            self.trace.append(("step", ev))
            self._round_done(ev.model, ev.round)
            return
        if isinstance(ev, M.Idle):
            self._round_done(ev.model, ev.round)
            return
        if isinstance(ev, M.Stats):
            box = self._stats.get(ev.token)
            if box is not None:
                box[ev.model] = ev
                self._stats_cv.notify_all()
            return
        if isinstance(ev, M.Finished) and ev.rid == -1:  # a sub-server died
            for h in list(self._reqs.values()):
                if not h.done.is_set() and h.t_admit is not None:
                    self._end(h, "failed", ev.error, self.clock())
            return
        h = self._reqs.get(ev.rid)
        if h is None or h.done.is_set():
            return
        if isinstance(ev, M.Committed):
            self.trace.append(("commit", ev.rid, ev.model, len(ev.tokens), ev.t))
            if h.t_first is None:
                h.t_first = ev.t
            h.output.token_ids.extend(ev.tokens)
            h.output.token_models.extend([ev.model] * len(ev.tokens))
            for fn in h.listeners:
                fn("tokens", ev)
        elif isinstance(ev, M.Hopped):
            self.trace.append(("hop", ev.rid, ev.src, ev.dst, ev.kept, ev.t))
            h.output.hops += 1
            h.output.discarded += 0 if ev.kept else 1
            if not ev.kept and ev.token is not None:
                h.output.discarded_log.append((len(h.output.token_ids), ev.token, ev.src))
            for fn in h.listeners:
                fn("hop", ev)
        elif isinstance(ev, M.Finished):
            self._end(h, ev.reason, ev.error, ev.t)

    def _end(self, h: RequestHandle, reason: str, error: str | None, t: float) -> None:
        out = h.output
        out.finish_reason, out.error = reason, error
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True) if out.token_ids else ""
        if reason == "stop":
            cuts = [text.find(s) for s in h.config.params.stop if s in text]
            text = text[:min(cuts)] if cuts else text
        out.text = text
        h.t_end = t
        t0 = h.t_admit if h.t_admit is not None else h.t_submit
        out.latency_s = t - t0
        out.ttft_s = None if h.t_first is None else h.t_first - t0
        self.trace.append(("finish", h.rid, reason, t))
        if h.t_admit is not None:
            self._inflight -= 1
            if self.mode == "delayed":
                self._broadcast_inflight()
        h.done.set()
        for fn in h.listeners:
            fn("finish", out)
        self._admit_more()

    # -- lifecycle ------------------------------------------------------------------------
    def wait(self, handles: list[RequestHandle], timeout: float | None = None,
             poll_s: float = 0.5) -> None:
        """Block until every handle is done; fail the rest if a sub-server thread died.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        deadline = None if timeout is None else time.perf_counter() + timeout
        for h in handles:
            while not h.done.wait(poll_s):
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"request {h.rid} did not finish within {timeout} s")
                self._check_alive()

    def _check_alive(self) -> None:
        dead = [m for m in self.models if not self.transport.alive(m)]
        if dead and not self._closed:
            self._handle_event(M.Finished(-1, dead[0], "crashed", f"sub-server '{dead[0]}' is not running", 0.0))

    def idle(self) -> bool:
        """True when no request is queued or in flight and every sub-server holds no request."""
        with self._lock:
            busy = self._inflight or self._queue
        return not busy and all(not ss.sched.seqs and ss.inbox.empty() for ss in self.subservers.values())

    def kv_stats(self, timeout: float = 10.0) -> dict[str, M.Stats]:
        """Each sub-server's KV pool and request counts (`Stats`), asked through the transport, so
        sub-servers in processes answer too. A sub-server answers after the messages sent to it
        before, so after `wait_idle` the counts include every release.

        Raises:
            TimeoutError: a sub-server did not answer within ``timeout`` seconds (names it).
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("kv_stats: the Router is closed (its sub-servers and KV pools are gone)")
        if self.subservers:  # in-process: read them directly (the sim backend steps only on demand)
            return {name: ss.stats() for name, ss in self.subservers.items()}
        with self._lock:
            self._next_token += 1
            token, box = self._next_token, {}
            self._stats[token] = box
        try:
            for name in self.models:
                self.transport.send(name, M.StatsQuery(token))
            deadline = time.perf_counter() + timeout
            with self._stats_cv:
                while len(box) < len(self.models):
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        missing = [m for m in self.models if m not in box]
                        raise TimeoutError(f"sub-server(s) {missing} did not report KV stats within {timeout} s; "
                                           f"are they alive? (Router.close() and a new Router restart them)")
                    self._stats_cv.wait(left)
            return {name: box[name] for name in self.models}
        finally:
            with self._lock:
                self._stats.pop(token, None)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.idle():
                return True
            time.sleep(0.01)
        return self.idle()

    def close(self) -> None:
        """Stop the sub-servers and the collector; unfinished requests end ``aborted``.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.transport.close()
        with self._lock:
            for h in self._reqs.values():
                if not h.done.is_set():
                    self._end(h, "aborted", "the Router was closed", self.clock())
        for r in self.runners.values():
            if hasattr(r, "release"):  # TorchRunner: the pool and its CUDA graphs
                r.release()
            else:
                r.pool.release()
