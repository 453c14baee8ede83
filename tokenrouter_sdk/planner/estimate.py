"""Per-model planner inputs from a pilot run's event trace: routing probability, commit rule on
handoff, extra fed tokens per step, scheduler overhead per step."""

from __future__ import annotations

from typing import Sequence

from ..engine.messages import Committed, Hopped, StepDone


def _trace(router_or_trace) -> list:
    tr = getattr(router_or_trace, "trace", router_or_trace)
    return list(tr)


def _models_of(trace: list, models: Sequence[str] | None) -> list[str]:
    if models is not None:
        return list(models)
    seen: list[str] = []
    for ev in trace:
        m = ev.model if isinstance(ev, (StepDone, Committed)) else None
        if m is not None and m not in seen:
            seen.append(m)
    return seen


def estimate_routing(router_or_trace, models: Sequence[str] | None = None) -> dict[str, float]:
    """Per-model routing probabilities from a pilot run.

    q_i = P(a request leaves model i after a step of model i) = handoffs out of i / request-steps
    on i (the sum of i's batch sizes), from the events (`Hopped` and `StepDone`). Models with no
    steps get q = 0.

    Args:
        router_or_trace: a `Router` (the events of its last call) or a list of events.
        models: model names to report (default: those seen in the trace, in order of appearance).
    """
    trace = _trace(router_or_trace)
    names = _models_of(trace, models)
    hops = {m: 0 for m in names}
    req_steps = {m: 0 for m in names}
    for ev in trace:
        if isinstance(ev, Hopped) and ev.src in hops:
            hops[ev.src] += 1
        elif isinstance(ev, StepDone) and ev.model in req_steps:
            req_steps[ev.model] += ev.batch_size
    return {m: (hops[m] / req_steps[m] if req_steps[m] else 0.0) for m in names}


def estimate_keep(router_or_trace, models: Sequence[str] | None = None) -> dict[str, float]:
    """Per model, the fraction of its handoffs that commit the sampled token first (``kept``);
    models without handoffs get 1.0."""
    trace = _trace(router_or_trace)
    names = _models_of(trace, models)
    kept = {m: [0, 0] for m in names}
    for ev in trace:
        if isinstance(ev, Hopped) and ev.src in kept:
            kept[ev.src][0] += bool(ev.kept)
            kept[ev.src][1] += 1
    return {m: (k / n if n else 1.0) for m, (k, n) in kept.items()}


def estimate_extra_tokens(router_or_trace, models: Sequence[str] | None = None) -> dict[str, float]:
    """Per model, mean tokens fed per request-step beyond one (prefill and extend cost, folded
    into the DTMC's step time as ``per_token_s * b * extra``)."""
    trace = _trace(router_or_trace)
    names = _models_of(trace, models)
    fed = {m: [0, 0] for m in names}
    for ev in trace:
        if isinstance(ev, StepDone) and ev.model in fed:
            fed[ev.model][0] += ev.tokens_fed - ev.batch_size
            fed[ev.model][1] += ev.batch_size
    return {m: (f / n if n else 0.0) for m, (f, n) in fed.items()}


def estimate_step_overhead(router_or_trace, models: Sequence[str] | None = None) -> dict[str, float]:
    """Per model, mean seconds of a step spent outside the model forward (batch building, sampling,
    routing, events: ``t_end - t_start - forward_s`` of its ``StepDone`` events)."""
    trace = _trace(router_or_trace)
    names = _models_of(trace, models)
    acc = {m: [0.0, 0] for m in names}
    for s in trace:
        if isinstance(s, StepDone) and s.model in acc:
            acc[s.model][0] += max(0.0, (s.t_end - s.t_start) - s.forward_s)
            acc[s.model][1] += 1
    return {m: (t / k if k else 0.0) for m, (t, k) in acc.items()}
