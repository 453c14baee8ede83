"""Prometheus metrics of one server, in its own `CollectorRegistry` (never the process-wide
default one, so several servers and Routers in one process do not mix).

Fed by `Engine.add_observer`: every event of the engine (requests from HTTP and from the
notebook alike) passes through `ServerMetrics.observe` on the engine's thread, which only
increments counters. Per-model KV and queue numbers come from each `StepDone`
(``kv_used_blocks``, ``queued``) and are refreshed from `Router.kv_stats` when ``/metrics`` is
scraped (a pool freed after its last step shows as free).

Metrics (prefix ``tokenrouter_``): ``committed_tokens_total{model}``,
``requests_finished_total{finish_reason}``, ``requests_admitted_total``, ``hops_total``,
``discarded_tokens_total``, ``hop_rate`` (hops / committed tokens), ``large_fraction`` (share of
committed tokens written by the largest model), ``requests_in_flight``, ``requests_waiting``
(not admitted yet), ``queued_requests{model}`` (owned but not in the last step),
``requests_owned{model}``, ``requests_pending{model}``, ``kv_used_blocks{model}``,
``kv_blocks{model}`` (usable), ``step_seconds{model}``, ``forward_seconds{model}``,
``step_batch_size{model}`` (histograms) and ``ttft_seconds`` (admission to first committed
token).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import messages

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Counters over every event of ``router``'s engine.

    Args:
        router: the served `Router`.

    Attributes:
        registry: the `CollectorRegistry` that ``/metrics`` renders.
    """

    def __init__(self, router):
        self.router = router
        self.models = list(router.models)
        self.large = self.models[-1]
        self.registry = reg = CollectorRegistry(auto_describe=True)
        p = "tokenrouter_"
        self.committed = Counter(
            p + "committed_tokens", "Committed output tokens by writing model", ["model"], registry=reg
        )
        self.finished = Counter(
            p + "requests_finished", "Requests ended, by finish reason", ["finish_reason"], registry=reg
        )
        self.admitted = Counter(p + "requests_admitted", "Requests admitted to the engine", registry=reg)
        self.hops = Counter(p + "hops", "Handoffs between models", registry=reg)
        self.discarded = Counter(p + "discarded_tokens", "Sampled tokens dropped on a handoff", registry=reg)
        self.queued = Gauge(
            p + "queued_requests", "Requests a model owned that were not in its last step", ["model"], registry=reg
        )
        self.owned = Gauge(
            p + "requests_owned", "Requests ready to step on a model (last kv_stats)", ["model"], registry=reg
        )
        self.pending = Gauge(
            p + "requests_pending",
            "Requests handed off with KV kept on a model (last kv_stats)",
            ["model"],
            registry=reg,
        )
        self.kv_used = Gauge(p + "kv_used_blocks", "KV blocks in use per model", ["model"], registry=reg)
        self.kv_total = Gauge(p + "kv_blocks", "Usable KV blocks per model", ["model"], registry=reg)
        self.kv_cached = Gauge(
            p + "kv_cached_blocks", "KV blocks in the prefix cache per model (held or idle)", ["model"], registry=reg
        )
        self.prefix_hit = Counter(
            p + "prefix_cache_hit_tokens",
            "Tokens taken from the prefix cache instead of prefilled, per model",
            ["model"],
            registry=reg,
        )
        self.prefix_query = Counter(
            p + "prefix_cache_query_tokens",
            "Tokens requests brought when they arrived at a model with no KV there (hit rate = hit / query)",
            ["model"],
            registry=reg,
        )
        self.step = Histogram(
            p + "step_seconds", "Step time per model, seconds", ["model"], buckets=STEP_BUCKETS, registry=reg
        )
        self.forward = Histogram(
            p + "forward_seconds", "Model forward time per step, seconds", ["model"], buckets=STEP_BUCKETS, registry=reg
        )
        self.batch = Histogram(
            p + "step_batch_size", "Requests per step per model", ["model"], buckets=BATCH_BUCKETS, registry=reg
        )
        self.ttft = Histogram(
            p + "ttft_seconds", "Admission to first committed token, seconds", buckets=TTFT_BUCKETS, registry=reg
        )
        Gauge(p + "hop_rate", "Hops per committed token since start", registry=reg).set_function(self.hop_rate)
        Gauge(
            p + "large_fraction", "Share of committed tokens written by the largest model since start", registry=reg
        ).set_function(self.large_fraction)
        counts = router.request_counts
        Gauge(p + "requests_in_flight", "Requests admitted and not ended", registry=reg).set_function(
            lambda: counts()["in_flight"]
        )
        Gauge(p + "requests_waiting", "Requests submitted and not admitted yet", registry=reg).set_function(
            lambda: counts()["waiting"]
        )
        self._lock = threading.Lock()
        self._tokens = {m: 0 for m in self.models}
        self._hops = 0
        self._admit_t: dict[int, float] = {}
        self._last_step: dict[str, float] = {}  # model -> time.monotonic() of its last StepDone
        self._by_model = {
            m: (
                self.committed.labels(m),
                self.step.labels(m),
                self.forward.labels(m),
                self.batch.labels(m),
                self.kv_used.labels(m),
                self.queued.labels(m),
                self.kv_cached.labels(m),
                self.prefix_hit.labels(m),
                self.prefix_query.labels(m),
            )
            for m in self.models
        }
        self._prefix = {m: [0, 0] for m in self.models}  # model -> [hit tokens, query tokens]
        hit_rate = Gauge(
            p + "prefix_cache_hit_rate",
            "Prefix-cache hit rate per model since start: tokens reused / tokens brought on arrival",
            ["model"],
            registry=reg,
        )
        for m in self.models:
            hit_rate.labels(m).set_function(lambda m=m: self.prefix_hit_rate(m))
        for m, (blocks, _) in router.kv_capacity.items():
            self.kv_total.labels(m).set(blocks)
            self.kv_used.labels(m).set(0)
            self.queued.labels(m).set(0)
        for reason in ("eos", "length", "stop", "aborted", "failed"):
            self.finished.labels(reason)
        self._remove = router.add_observer(self.observe)

    # -- the observer (engine thread, under its lock: counters only) ---------------------------
    def observe(self, ev) -> None:
        if isinstance(ev, messages.Committed):
            n = len(ev.tokens)
            row = self._by_model.get(ev.model)
            if row is not None:
                row[0].inc(n)
            with self._lock:
                self._tokens[ev.model] = self._tokens.get(ev.model, 0) + n
            t0 = self._admit_t.pop(ev.rid, None)
            if t0 is not None:
                self.ttft.observe(max(0.0, ev.t - t0))
        elif isinstance(ev, messages.StepDone):
            self._last_step[ev.model] = time.monotonic()
            row = self._by_model.get(ev.model)
            if row is not None:
                row[1].observe(ev.t_end - ev.t_start)
                row[2].observe(ev.forward_s)
                row[3].observe(ev.batch_size)
                row[4].set(ev.kv_used_blocks)
                row[5].set(ev.queued)
                row[6].set(ev.kv_cached_blocks)
                if ev.cache_query_tokens or ev.cache_hit_tokens:
                    row[7].inc(ev.cache_hit_tokens)
                    row[8].inc(ev.cache_query_tokens)
                    with self._lock:
                        acc = self._prefix[ev.model]
                        acc[0] += ev.cache_hit_tokens
                        acc[1] += ev.cache_query_tokens
        elif isinstance(ev, messages.Hopped):
            self.hops.inc()
            if not ev.kept:
                self.discarded.inc()
            with self._lock:
                self._hops += 1
        elif isinstance(ev, messages.Admitted):
            self.admitted.inc()
            self._admit_t[ev.rid] = ev.t
        elif isinstance(ev, messages.Finished):
            self.finished.labels(ev.reason).inc()
            self._admit_t.pop(ev.rid, None)

    # -- derived values --------------------------------------------------------------------------
    def totals(self) -> dict:
        """``{"committed_tokens", "hops", "hop_rate", "large_fraction"}`` since the server started."""
        with self._lock:
            total = sum(self._tokens.values())
            hops, large = self._hops, self._tokens.get(self.large, 0)
        return {
            "committed_tokens": total,
            "hops": hops,
            "hop_rate": hops / total if total else 0.0,
            "large_fraction": large / total if total else 0.0,
        }

    def step_ages(self) -> dict[str, float]:
        """Seconds since each model's last step (models that never stepped are left out)."""
        now = time.monotonic()
        return {m: now - t for m, t in dict(self._last_step).items()}

    def prefix_hit_rate(self, model: str) -> float:
        """Tokens ``model`` took from its prefix cache / tokens requests brought to it, since start."""
        with self._lock:
            hit, query = self._prefix.get(model, (0, 0))
        return hit / query if query else 0.0

    def hop_rate(self) -> float:
        return self.totals()["hop_rate"]

    def large_fraction(self) -> float:
        return self.totals()["large_fraction"]

    def refresh(self, timeout: float = 2.0) -> None:
        """Per-model KV and request counts from `Router.kv_stats` (blocks; may block up to
        ``timeout`` seconds: call it off the event loop). A sub-server that does not answer keeps
        its last values."""
        try:
            stats = self.router.kv_stats(timeout)
        except (TimeoutError, RuntimeError):
            return
        for m, s in stats.items():
            if s.alive:
                self.kv_used.labels(m).set(s.num_blocks - s.free_blocks)
                self.kv_cached.labels(m).set(s.cached_blocks)
                self.owned.labels(m).set(s.owned)
                self.pending.labels(m).set(s.pending)

    def render(self) -> bytes:
        """The Prometheus text exposition of this server's registry."""
        return generate_latest(self.registry)

    def close(self) -> None:
        """Stop observing the engine."""
        self._remove()
