"""The planner: DTMC throughput model, threshold search, profiling and pilot estimates."""

import random

import numpy as np
import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.backends.sim_runner import LatencyModel
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.messages import Committed, StepDone
from tokenrouter_sdk.planner import (
    Plan,
    StateSpaceTooLarge,
    _gmres_stationary,
    dtmc_throughput,
    estimate_extra_tokens,
    estimate_keep,
    estimate_routing,
    feasible_thresholds,
    plan_from_trace,
    plan_thresholds,
    profile_latency,
)
from tokenrouter_sdk.policies import RandomRouting

from ..helpers import mixed_prompts

LAT = {
    "small": LatencyModel({1: 0.024, 8: 0.039, 16: 0.051, 64: 0.12}),
    "large": LatencyModel({1: 0.064, 8: 0.110, 16: 0.158, 64: 0.4}),
}


def prompts(n, seed=0, length=20):
    rng = random.Random(seed)
    return [[rng.randint(3, 250) for _ in range(length)] for _ in range(n)]


def sim(n, p, thresholds=None, mode="delayed", requests=None, new=64, seed=1):
    with Router(
        LAT, RandomRouting(p=p, seed=seed), backend="sim", mode=mode, thresholds=thresholds, max_concurrency=n
    ) as r:
        r.generate(prompts(requests or 4 * n), max_new_tokens=new, ignore_eos=True, timeout=120)
        return r.metrics(), list(r.trace)


# -- the chain on cases with known answers ------------------------------------------------------
@pytest.mark.parametrize("n,b", [(1, 1), (4, 1), (4, 4), (6, 3)])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_one_model_only_is_n_over_step_time(n, b, rounding):
    # q = 0 on the entry model: the other model never runs; every step carries all N requests
    lat = {"small": LatencyModel({1: 0.010, 8: 0.024}, per_token_s=0.0), "large": LatencyModel({1: 0.05})}
    r = dtmc_throughput(lat, {"small": 0.0, "large": 1.0}, n, {"small": b, "large": 1}, dt=0.001, rounding=rounding)
    assert r.tok_s == pytest.approx(n / lat["small"].step_s(n), rel=1e-6)
    assert r.busy["small"] == pytest.approx(1.0) and r.busy["large"] == 0.0
    assert r.mean_batch["small"] == pytest.approx(n)


def test_stochastic_rounding_keeps_the_mean_step_time():
    lat = {"small": LatencyModel({1: 0.0137}), "large": LatencyModel({1: 0.05})}
    for dt in (0.001, 0.004, 0.006):
        r = dtmc_throughput(lat, {"small": 0.0, "large": 1.0}, 3, {}, dt=dt)
        assert r.tok_s == pytest.approx(3 / 0.0137, rel=1e-6)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_ping_pong_with_deterministic_latencies(n):
    # q = 1 both ways: all N requests move together, small (20 ms) then large (30 ms)
    lat = {"small": LatencyModel({1: 0.02}, per_token_s=0.0), "large": LatencyModel({1: 0.03}, per_token_s=0.0)}
    q = {"small": 1.0, "large": 1.0}
    keep_both = dtmc_throughput(lat, q, n, {}, keep={"small": 1.0, "large": 1.0}, dt=0.005)
    assert keep_both.tok_s == pytest.approx(2 * n / 0.05)
    r2r = dtmc_throughput(lat, q, n, {}, dt=0.005)  # default: the small model discards on leaving
    assert r2r.tok_s == pytest.approx(n / 0.05)
    assert r2r.busy == pytest.approx({"small": 0.4, "large": 0.6})


def test_extra_tokens_price_the_step():
    lat = {"small": LatencyModel({1: 0.01}, per_token_s=0.001), "large": LatencyModel({1: 0.05})}
    r = dtmc_throughput(lat, {"small": 0.0, "large": 1.0}, 2, {}, extra_tokens={"small": 5, "large": 0}, dt=0.001)
    assert r.tok_s == pytest.approx(2 / (0.01 + 0.001 * 2 * 5))


def test_gmres_solves_a_small_chain():
    # 3-state chain, stationary law known in closed form
    P = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.4, 0.6]])
    src, dst = np.nonzero(P)
    pi, resid = _gmres_stationary(src, dst, P[src, dst], 3)
    evals, evecs = np.linalg.eig(P.T)
    ref = np.real(evecs[:, np.argmin(abs(evals - 1))])
    assert pi == pytest.approx(ref / ref.sum(), abs=1e-9) and resid < 1e-9


def test_more_delay_on_the_large_model_means_larger_large_batches():
    q = {"small": 0.1, "large": 1.0}
    lo = dtmc_throughput(LAT, q, 8, {"small": 1, "large": 1})
    hi = dtmc_throughput(LAT, q, 8, {"small": 1, "large": 5})
    assert hi.mean_batch["large"] > lo.mean_batch["large"] >= 1.0
    assert hi.busy["large"] < lo.busy["large"]


# -- guards ------------------------------------------------------------------------------------
def test_feasible_thresholds():
    c = feasible_thresholds(["small", "large"], 4)
    assert len(c) == 10 and all(sum(b - 1 for b in x.values()) < 4 for x in c)
    assert {"small": 4, "large": 1} in c and {"small": 3, "large": 3} not in c
    assert len(feasible_thresholds(["a", "b", "c"], 3)) == 10


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="two models"):
        dtmc_throughput({"a": LAT["small"]}, {"a": 0.1}, 4, {})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dtmc_throughput(LAT, {"small": 1.5, "large": 1.0}, 4, {})
    with pytest.raises(ValueError, match="no entry for model"):
        dtmc_throughput(LAT, {"small": 0.1}, 4, {})
    with pytest.raises(ValueError, match="search"):
        plan_thresholds(LAT, {"small": 0.1, "large": 1.0}, 4, search="bogus")


def test_state_space_guard():
    q = {"small": 0.1, "large": 1.0}
    with pytest.raises(StateSpaceTooLarge, match="max_states"):
        dtmc_throughput(LAT, q, 16, {}, dt=0.001, max_states=2000)
    # without a fixed dt the tick is coarsened until it fits
    fine = dtmc_throughput(LAT, q, 16, {}, ticks=8)
    coarse = dtmc_throughput(LAT, q, 16, {}, ticks=8, max_states=fine.states // 3)
    assert coarse.dt > fine.dt and coarse.states <= fine.states // 3
    assert coarse.tok_s == pytest.approx(fine.tok_s, rel=0.05)


def test_tail_rule_in_the_chain():
    # infeasible thresholds for N: the tail rule launches at 1 ready request, so no deadlock
    r = dtmc_throughput(LAT, {"small": 0.1, "large": 1.0}, 3, {"small": 3, "large": 3})
    a = dtmc_throughput(LAT, {"small": 0.1, "large": 1.0}, 3, {"small": 1, "large": 1})
    assert r.tok_s == pytest.approx(a.tok_s)


def test_n_32_solves_in_seconds():
    import time

    t = time.perf_counter()
    r = dtmc_throughput(
        LAT, {"small": 0.1, "large": 1.0}, 32, {"small": 1, "large": 1}, extra_tokens={"small": 0.15, "large": 9.0}
    )
    assert time.perf_counter() - t < 10 and r.residual < 1e-8 and r.tok_s > 0


# -- search ------------------------------------------------------------------------------------
def test_plan_only_feasible_and_best_first():
    q = {"small": 0.1, "large": 1.0}
    plan = plan_thresholds(LAT, q, 6, search="exhaustive")
    assert isinstance(plan, Plan) and plan.search == "exhaustive"
    assert len(plan.table) == plan.candidates == 21
    assert all(sum(b - 1 for b in row["thresholds"].values()) < 6 for row in plan.table)
    assert plan.table[0]["thresholds"] == plan.thresholds
    # the pick is re-solved with finer ticks; the coarse rest of the table is within 1% of that
    assert plan.predicted_tok_s >= 0.99 * max(row["tok_s"] for row in plan.table)
    assert plan.table[0]["tok_s"] == plan.predicted_tok_s


@pytest.mark.parametrize("n", [6, 12])
def test_pruned_search_finds_the_exhaustive_optimum(n):
    q = {"small": 0.1, "large": 1.0}
    ex = {"small": 0.15, "large": 9.0}
    full = plan_thresholds(LAT, q, n, extra_tokens=ex, search="exhaustive")
    pruned = plan_thresholds(LAT, q, n, extra_tokens=ex, search="pruned")
    assert pruned.search == "pruned" and len(pruned.table) < len(full.table)
    assert pruned.predicted_tok_s == pytest.approx(full.predicted_tok_s, rel=0.005)


# -- measurement -------------------------------------------------------------------------------
def test_profile_latency_on_a_tiny_model():
    from tokenrouter_sdk.backends.torch_runner import TorchRunner
    from tokenrouter_sdk.models import tiny_model

    runner = TorchRunner(tiny_model(dtype=__import__("torch").float32), max_kv_tokens=2048)
    free = blocks_of(runner).num_free
    lat = profile_latency(runner, batch_sizes=(1, 2, 4, 8), context=16, steps=3, warmup=1, extend_tokens=8)
    assert sorted(lat.table) == [1, 2, 4, 8]
    assert all(0 < t < 1.0 for t in lat.table.values())
    assert lat.table[8] > 0.5 * lat.table[1]  # increasing-ish (timings on a busy CPU are noisy)
    assert lat.per_token_s >= 0
    assert blocks_of(runner).num_free == free
    # a bare model works too (wrapped in a TorchRunner)
    lat2 = profile_latency(tiny_model(), batch_sizes=(1, 2), context=8, steps=2, warmup=1, extend_tokens=0)
    assert sorted(lat2.table) == [1, 2] and lat2.per_token_s == 0.0


def test_estimates_from_a_sim_pilot_recover_p():
    p = 0.3
    m, trace = sim(8, p, mode="async", requests=16, new=64)
    q = estimate_routing(trace)
    assert set(q) == {"small", "large"}
    assert q["small"] == pytest.approx(p, abs=0.04)
    assert q["large"] > 0.95  # the large model writes one token and returns (unless it finishes the request)
    assert estimate_keep(trace) == {"small": 0.0, "large": 1.0}
    extra = estimate_extra_tokens(trace)
    assert extra["large"] == pytest.approx((1 - p) / p, rel=0.5) and extra["small"] < 1.0
    assert m.large_fraction == pytest.approx(p, abs=0.05)


def test_planner_pick_matches_a_brute_force_sim_sweep():
    n, p = 4, 0.1
    _, pilot = sim(n, p, mode="async", requests=24, new=64, seed=11)
    plan = plan_from_trace(pilot, LAT, n)
    sims = {tuple(th.values()): sim(n, p, th, new=64)[0].throughput_tok_s for th in feasible_thresholds(LAT, n)}
    best = max(sims.values())
    at_plan = sims[(plan.thresholds["small"], plan.thresholds["large"])]
    assert at_plan >= 0.95 * best, (plan.thresholds, sims)
    assert plan.predicted_tok_s == pytest.approx(at_plan, rel=0.15)


# -- for a Router ------------------------------------------------------------------------------
class CoinFlip(RandomRouting):
    """RandomRouting under another name: the planner must run a pilot for it."""


def test_plan_for_a_sim_router_analytic_and_pilot():
    from tokenrouter_sdk.planner import plan_for_router, plan_router, router_latency

    with Router(LAT, RandomRouting(0.1), backend="sim", mode="delayed", thresholds={"small": 3, "large": 2}) as r:
        assert router_latency(r) == LAT
        th = plan_for_router(r, RandomRouting(0.1), 8)
        assert set(th) == {"small", "large"} and sum(b - 1 for b in th.values()) < 8
        seen: list = []
        stop = r.engine.add_observer(seen.append)
        plan = plan_router(r, CoinFlip(0.2, seed=3), 6, pilot_tokens=48)
        stop()
        assert any(isinstance(ev, Committed) for ev in seen)  # a pilot ran on the router
        assert r.engine.thresholds == {"small": 3, "large": 2}  # and the thresholds came back
        assert sum(b - 1 for b in plan.thresholds.values()) < 6 and plan.predicted_tok_s > 0


def test_router_latency_profiles_torch_models_once(monkeypatch):
    import torch

    from tokenrouter_sdk.models import tiny_model, tiny_tokenizer
    from tokenrouter_sdk.planner import router_latency

    small, large = tiny_model(num_layers=1, dtype=torch.float32), tiny_model(num_layers=2, dtype=torch.float32)
    with Router({"small": small, "large": large}, tokenizer=tiny_tokenizer(), processes=False) as r:
        lat = router_latency(r, 4, context=8, steps=1, warmup=1, extend_tokens=0)
        assert sorted(lat["small"].table) == [1, 2, 4, 8, 16] and all(t > 0 for t in lat["large"].table.values())
        assert router_latency(r, 4)["small"] is lat["small"]  # cached
        # profiles are kept per torch thread count: sub-server processes with k threads each get
        # a k-thread profile, measured under k threads; this process's setting is restored after
        seen = []
        real = torch.set_num_threads
        old = torch.get_num_threads()
        monkeypatch.setattr(type(r.engine.transport), "child_threads", old + 1)  # as sub-server processes
        try:
            torch.set_num_threads = lambda k: (seen.append(k), real(k))[1]
            other = router_latency(r, 4, context=8, steps=1, warmup=1, extend_tokens=0)
        finally:
            torch.set_num_threads = real
            monkeypatch.undo()
        assert seen == [old + 1, old] * 2 and torch.get_num_threads() == old  # once per model
        assert other["small"] is not lat["small"]
        assert set(small._tokenrouter_latency) == {old, old + 1}
        assert router_latency(r, 4)["small"] is lat["small"]


def test_analytic_plan_adds_the_measured_step_overhead_once_the_router_has_history(pair, tok):
    """RandomRouting is planned without a pilot; once the Router has run enough steps of both
    models, their time outside the forward is added to the step latencies, so the predicted
    throughput drops by about what that overhead costs."""
    from tokenrouter_sdk.planner import estimate_step_overhead, plan_router
    from tokenrouter_sdk.planner.for_router import HISTORY_EVENTS

    lat = {"small": LatencyModel({1: 0.002, 4: 0.003}, 0.0001), "large": LatencyModel({1: 0.004, 4: 0.006}, 0.0002)}
    pol = RandomRouting(0.3, seed=1)
    with Router(pair, pol, tokenizer=tok, processes=False) as r:
        fresh = plan_router(r, pol, 4, latency=lat)
        r.generate(mixed_prompts(8, seed=3), max_new_tokens=24, ignore_eos=True, concurrency=4)
        steps = [ev for ev in list(r.engine.recent)[-HISTORY_EVENTS:] if isinstance(ev, StepDone)]
        assert min(sum(ev.model == m for ev in steps) for m in ("small", "large")) >= 20
        over = estimate_step_overhead(steps, ["small", "large"])
        assert all(v > 0 for v in over.values())
        later = plan_router(r, pol, 4, latency=lat)
    with_over = {m: LatencyModel({b: t + over[m] for b, t in lat[m].table.items()}, lat[m].per_token_s) for m in lat}
    want = plan_thresholds(
        with_over,
        {"small": 0.3, "large": 1.0},
        4,
        keep={"small": 0.0, "large": 1.0},
        extra_tokens={"small": 0.0, "large": 0.7 / 0.3},
    )
    assert later.predicted_tok_s < fresh.predicted_tok_s
    assert later.predicted_tok_s == pytest.approx(want.predicted_tok_s, rel=1e-9)
