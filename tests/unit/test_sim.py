"""The simulated backend: real sub-servers and engine, simulated time."""

import random
import time

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.backends.sim_runner import LatencyModel
from tokenrouter_sdk.policies import LargeOnly, RandomRouting

LAT = {
    "small": LatencyModel({1: 0.024, 8: 0.039, 16: 0.051, 64: 0.12}),
    "large": LatencyModel({1: 0.064, 8: 0.110, 16: 0.158, 64: 0.4}),
}


def prompts(n, seed=0, length=20):
    rng = random.Random(seed)
    return [[rng.randint(3, 250) for _ in range(length)] for _ in range(n)]


def run(mode, n, p=0.1, thresholds=None, new=64, **kw):
    with Router(LAT, RandomRouting(p=p, seed=1), backend="sim", mode=mode, thresholds=thresholds, **kw) as r:
        outs = r.generate(prompts(n), max_new_tokens=new, ignore_eos=True, timeout=120)
        return outs, r.metrics()


def test_simulated_time_is_exact():
    lat = {"large": LatencyModel({1: 0.1}, per_token_s=0.01)}
    with Router(lat, LargeOnly(), backend="sim") as r:
        out = r.generate([[5] * 11], max_new_tokens=10, ignore_eos=True)[0]
        m = r.metrics()
    # prefill of 11 tokens = 0.1 + 10 * 0.01, then 9 decodes of 0.1
    assert len(out.token_ids) == 10 and m.wall_s == pytest.approx(0.2 + 0.9)
    assert m.per_model["large"].steps == 10


def test_deterministic_and_fast_at_n_256():
    t = time.perf_counter()
    a, ma = run("async", 256)
    real = time.perf_counter() - t
    b, mb = run("async", 256)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_models for o in a] == [o.token_models for o in b]
    assert ma.wall_s == mb.wall_s and ma.committed_tokens == 256 * 64
    assert real < 60, f"N=256 took {real:.1f} s of real time"
    assert 0.05 < ma.large_fraction < 0.15


def test_mode_ordering_in_simulation():
    thr = {
        mode: run(mode, 16, thresholds=th)[1].throughput_tok_s
        for mode, th in [("sync", None), ("model_sync", None), ("async", None), ("delayed", {"small": 6, "large": 4})]
    }
    assert thr["model_sync"] < thr["sync"] < thr["async"], thr
    assert thr["delayed"] > thr["sync"], thr


def test_retain_kv_false_costs_reprefill_in_simulation():
    _, keep = run("async", 8, p=0.3, new=128)
    _, drop = run("async", 8, p=0.3, new=128, retain_kv=False, prefix_cache=False)
    assert drop.per_model["small"].tokens_fed > 3 * keep.per_model["small"].tokens_fed
    assert drop.throughput_tok_s < keep.throughput_tok_s
    _, cached = run("async", 8, p=0.3, new=128, retain_kv=False)  # a return finds its blocks in the prefix cache
    assert (
        keep.per_model["small"].tokens_fed < cached.per_model["small"].tokens_fed < drop.per_model["small"].tokens_fed
    )


def test_throughput_grows_with_concurrency():
    t1 = run("async", 1)[1].throughput_tok_s
    t16 = run("async", 16)[1].throughput_tok_s
    assert t16 > 4 * t1


def test_auto_thresholds_use_the_planner():
    with Router(LAT, RandomRouting(p=0.1, seed=1), backend="sim", mode="delayed", thresholds="auto") as r:
        outs = r.generate(prompts(16), max_new_tokens=32, ignore_eos=True, concurrency=8)
        th = dict(r.engine.thresholds)
    assert all(o.finish_reason == "length" for o in outs)
    assert sum(b - 1 for b in th.values()) < 8 and all(b >= 1 for b in th.values())
    from tokenrouter_sdk.planner import plan_for_router

    with Router(LAT, RandomRouting(p=0.1, seed=1), backend="sim", mode="delayed") as r2:
        assert plan_for_router(r2, RandomRouting(p=0.1, seed=1), 8) == th
    with pytest.raises(ValueError, match="'auto'"):
        Router(LAT, backend="sim", thresholds="best")
