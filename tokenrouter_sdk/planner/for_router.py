"""The planner for a live Router: profiles its models, runs a pilot, plans (``thresholds="auto"``)."""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from ..backends.sim_runner import LatencyModel
from ..engine.messages import StepDone
from .estimate import estimate_extra_tokens, estimate_keep, estimate_routing, estimate_step_overhead
from .profile import profile_latency
from .search import Plan, plan_thresholds

HISTORY_EVENTS = 4000  # recent engine events the analytic RandomRouting plan reads the per-step overhead from
PROFILE_ATTR = "_tokenrouter_latency"  # a model's profiles: {torch threads (or (threads, "cuda_graphs")): LatencyModel}
PILOT_PROMPTS = (
    "Explain why the sky is blue in a few sentences.",
    "What is 17 * 23? Show your steps.",
    "Write a short story about a robot who learns to paint.",
    "List three uses of a paperclip and explain each one.",
    "Summarise the water cycle for a ten-year-old.",
    "Give two arguments for and against homework.",
)


@contextlib.contextmanager
def _torch_threads(n: int | None):
    """Run the block with ``torch.set_num_threads(n)`` (restored afterwards); None: unchanged."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(old)


def router_latency(router, n: int = 16, **profile_kw) -> dict[str, LatencyModel]:
    """Each model's `LatencyModel`: the sim backend's own, or `profile_latency` of the loaded
    model (batch sizes 1, 2, 4, ... up to max(n, 16); cached per model object, so a benchmark
    profiles each model once). Profiling runs on a private KV pool; call it while the Router is
    idle (it competes for the CPU with running requests). With sub-servers in processes it runs
    with the torch thread count each sub-server process uses, so the latencies are the ones the
    sub-servers see. Runners with ``cuda_graphs`` are profiled with graphs (cached apart)."""
    out = {}
    top = max(16, n)
    sizes = tuple(sorted({1 << k for k in range(top.bit_length()) if 1 << k <= top} | {top}))
    for name in router.models:
        runner = router.runners[name]
        lat = getattr(runner, "latency", None)
        if isinstance(lat, LatencyModel):
            out[name] = lat
            continue
        model = router.models[name]
        threads = router.child_threads or torch.get_num_threads()
        graphs = bool(getattr(runner, "cuda_graphs", False))
        key = (threads, "cuda_graphs") if graphs else threads
        # kept on the model object itself (not in a global), per torch thread count (and graphs)
        store = getattr(model, PROFILE_ATTR, None)
        if isinstance(store, LatencyModel):  # set by hand: used whatever the thread count
            store = {key: store}
        store = dict(store or {})
        cached = store.get(key)
        if cached is None or max(cached.table) < top:
            with _torch_threads(threads):
                cached = profile_latency(
                    model, batch_sizes=sizes, **({"cuda_graphs": True} if graphs else {}), **profile_kw
                )
            store[key] = cached
            setattr(model, PROFILE_ATTR, store)
        out[name] = cached
    return out


def plan_router(
    router,
    policy,
    n: int,
    *,
    trace: list | None = None,
    prompts: Sequence | None = None,
    pilot_tokens: int = 64,
    latency: dict[str, LatencyModel] | None = None,
    **kw,
) -> Plan:
    """Plan delayed-batching thresholds for ``router`` serving ``policy`` at concurrency ``n``.

    Inputs: latency from `router_latency` (unless given); routing, commit rule and extra fed
    tokens from ``trace`` if given, else analytically for `RandomRouting` (q_small = p,
    q_large = 1, the small discards, the large keeps, (1 - p) / p extra tokens per large step;
    when the router has already run at least 20 steps of each model, on a real backend, their
    measured per-step overhead outside the forward is added to the step times, from the last
    ``HISTORY_EVENTS`` trace events),
    else from a pilot run on the router itself: ``max(n, 4)`` requests of ``prompts`` (default
    `PILOT_PROMPTS`, cycled), ``pilot_tokens`` tokens each, at concurrency n with thresholds 1
    (restored afterwards). With a pilot trace on a real backend, the measured per-step overhead
    outside the forward is added to the profiled step times.

    Raises:
        ValueError: the router does not hold exactly two models (the DTMC covers two).
    """
    names = list(router.models)
    if len(names) != 2:
        raise ValueError(f"the planner covers two models (small, large), this Router has {names}")
    lat = dict(latency) if latency is not None else router_latency(router, n)
    if trace is None and type(policy).__name__ == "RandomRouting" and hasattr(policy, "p"):
        p = float(policy.p)
        small = getattr(policy, "small", None) or names[0]
        large = getattr(policy, "large", None) or names[-1]
        q = {small: p, large: 1.0}
        kw.setdefault("keep", {small: 0.0, large: 1.0})
        kw.setdefault("extra_tokens", {small: 0.0, large: (1 - p) / p if p > 0 else 0.0})
        recent = [ev for ev in router.recent_events()[-HISTORY_EVENTS:] if isinstance(ev, StepDone)]
        return plan_thresholds(_with_overhead(router, lat, names, recent, min_steps=20), q, n, **kw)
    if trace is None:
        trace = pilot_trace(router, policy, n, prompts, pilot_tokens)
        lat = _with_overhead(router, lat, names, trace, min_steps=1)
    kw.setdefault("keep", estimate_keep(trace, names))
    kw.setdefault("extra_tokens", estimate_extra_tokens(trace, names))
    return plan_thresholds(lat, estimate_routing(trace, names), n, **kw)


def pilot_trace(router, policy, n: int, prompts: Sequence | None = None, pilot_tokens: int = 64) -> list:
    """The events of a pilot call through the engine: ``max(n, 4)`` requests of ``prompts``
    (default `PILOT_PROMPTS`, cycled), ``pilot_tokens`` tokens each (EOS ignored), at concurrency
    ``n``, with every delayed-batching threshold at 1 meanwhile (restored afterwards)."""
    from ..request import SamplingParams

    plist = list(prompts or PILOT_PROMPTS)
    plist = [plist[i % len(plist)] for i in range(max(n, 4))]
    reqs = router.requests(plist, sampling=SamplingParams(max_new_tokens=pilot_tokens, ignore_eos=True))
    old = router.thresholds
    delayed = router.config.mode.batches_delayed
    if delayed:
        router.set_thresholds({m: 1 for m in router.models})
    try:
        call = router.submit_unplanned(reqs, policy, concurrency=n)
        try:
            call.wait()
        except BaseException:
            call.abort("the planner's pilot was interrupted")
            raise
    finally:
        if delayed:
            router.set_thresholds(old)
    return list(call.events)


def _with_overhead(
    router, lat: dict[str, LatencyModel], names: list[str], trace: list, min_steps: int
) -> dict[str, LatencyModel]:
    """``lat`` plus each model's measured per-step overhead outside the forward
    (`estimate_step_overhead` of ``trace``), when the backend is real and ``trace`` holds at least
    ``min_steps`` steps of every model; else ``lat`` unchanged (the sim backend has no overhead)."""
    if any(isinstance(getattr(r, "latency", None), LatencyModel) for r in router.runners.values()):
        return lat
    counts = {m: sum(1 for ev in trace if isinstance(ev, StepDone) and ev.model == m) for m in names}
    if min(counts.values()) < max(1, min_steps):
        return lat
    over = estimate_step_overhead(trace, names)
    return {m: LatencyModel({b: t + over[m] for b, t in lat[m].table.items()}, lat[m].per_token_s) for m in names}


def plan_for_router(router, policy, n: int, **kw) -> dict[str, int]:
    """The thresholds of `plan_router` (what ``tokenrouter bench --thresholds auto`` uses)."""
    return plan_router(router, policy, n, **kw).thresholds
