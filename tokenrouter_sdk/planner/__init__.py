"""Delayed-batching planner: a discrete-time Markov chain (DTMC) throughput model and a threshold search.

Source: the TokenRouter paper (arXiv 2610.12242), appendix "performance model": a DTMC whose state is
each model's queue length, the batch size of its running step and the step's remaining time, driven
by the concurrency N, per-model routing probabilities and per-model step latency as a function of
batch size; its steady state gives committed tokens per second for each feasible threshold vector
(sum_i (B_i - 1) < N), and delayed batching uses the best one.
The paper body is not available to us in full; the chain below is our reconstruction of it from the
description above and the scheduler's launch rule (`SubServer.delayed_ok`).

The model (two models; index 0 is the entry model, e.g. ``"small"``):
  * N requests circulate forever (closed network: a finished request is replaced at once by a new
    one on the entry model, which is what ``max_concurrency=N`` with a long queue does).
  * Time is cut into ticks of ``dt`` seconds. A request in model i's queue waits. When model i is
    idle and its queue holds >= B_i requests (or any request, if the thresholds are infeasible for
    N: the tail rule), it launches one step over all of them (at most ``max_batch``); the step
    takes ``latency_i(b) + per_token_s * b * extra_tokens_i`` seconds, rounded to ticks
    (stochastically by default: floor or ceil with the probabilities that keep the mean exact).
  * When the step ends, each of its b requests independently leaves to the other model with
    probability q_i (a handoff) or rejoins model i's queue (so the run length of a request on a
    model is geometric). Every request that stays commits one token; one that leaves commits one
    if model i keeps its sampled token on handoff (``keep[i]``), none if it discards it (R2R /
    `RandomRouting`: the small model discards, the large one writes exactly one token and
    returns, q_large = 1, keep_large = 1).
  * Committed tokens per second = expected tokens committed per tick in steady state / dt.

Between two step completions the tick chain moves deterministically (every remaining time counts
down by one), so it is solved exactly through its embedded chain at completion epochs: states are
the configurations right after a completion (and the launches it allows), and throughput is
E[tokens per epoch] / E[ticks per epoch] under the embedded chain's stationary law (renewal-reward).
The stationary law is found with restarted GMRES (numpy only) on ``(I - P^T + 1 1^T / n) pi = 1/n``.

Assumptions (what the model ignores; see `evals/planner/sim_sweep.py` for how far it is off):
  * stationary routing probabilities: q_i does not change over a request's life or with load;
  * independent requests: each request's routing draw is independent of the others in its batch;
  * geometric run lengths: a request's number of consecutive steps on model i is geometric with
    mean 1/q_i (true for `RandomRouting`; a policy with bursts of hard tokens violates it);
  * steady-state decode: prefill and the variable cost of extends are folded into a mean extra
    fed-token cost per request-step (``extra_tokens``), the workload's start and drain are not
    modelled (N is constant), and scheduler overhead is zero (as in the sim backend); on a real
    backend `plan_router` adds the overhead measured outside the forward (a pilot's, or the
    Router's recent steps) to the step times.

Size and speed: the embedded chain has ~17k states at N = 32 with 2 ticks per shortest step (the
search resolution of `plan_thresholds`), ~35k with 4; one solve takes 0.1-0.5 s on one CPU core,
a pruned N = 32 plan ~50 solves. ``max_states`` guards the size (the tick is coarsened, then
`StateSpaceTooLarge` is raised). Against the sim backend (`evals/planner/sim_sweep.py`) the prediction
is a few percent high: the sim's whole-run throughput includes the start (all N requests enter
at once) and the drain of the workload, which the steady-state chain does not see.

Usage (what ``thresholds="auto"`` does): a short pilot run for the inputs, then the plan::

    pilot = Router(lat, policy, backend="sim", max_concurrency=N)     # or the real models
    pilot.generate(prompts, max_new_tokens=128)
    plan = plan_from_trace(pilot, lat, N)    # lat: {name: LatencyModel}, e.g. from profile_latency
    Router(lat, policy, backend="sim", mode="delayed", thresholds=plan.thresholds, max_concurrency=N)

Also here: `profile_latency` (decode-step latency of a real model as a function of batch size,
through `TorchRunner`), `estimate_routing` and friends (per-model inputs from a pilot run's event
trace) and `plan_thresholds` (search of the feasible thresholds).
"""

from __future__ import annotations

from .dtmc import DTMCResult, StateSpaceTooLarge, _gmres_stationary, dtmc_throughput  # noqa: F401
from .estimate import estimate_extra_tokens, estimate_keep, estimate_routing, estimate_step_overhead
from .for_router import PILOT_PROMPTS, plan_for_router, plan_router, router_latency
from .profile import profile_latency
from .search import Plan, feasible_thresholds, plan_from_trace, plan_thresholds

__all__ = [
    "profile_latency",
    "estimate_routing",
    "estimate_keep",
    "estimate_extra_tokens",
    "DTMCResult",
    "StateSpaceTooLarge",
    "estimate_step_overhead",
    "router_latency",
    "plan_router",
    "plan_for_router",
    "dtmc_throughput",
    "Plan",
    "feasible_thresholds",
    "plan_thresholds",
    "plan_from_trace",
    "PILOT_PROMPTS",
]
