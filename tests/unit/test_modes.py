"""Schedule modes (async, delayed, sync, model_sync) and retain_kv=False on one engine:
same tokens as the naive reference, and each mode's scheduling property from the trace."""

import random

import pytest

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.engine.messages import Admitted, Finished, StepDone
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate

from ..helpers import Cycle3, DiscardTwoBack, mixed_prompts, pools_free

MODES = [("async", {}), ("delayed", {"small": 3, "large": 2}), ("sync", {}), ("model_sync", {})]


def steps_of(trace):
    return [ev for ev in trace if isinstance(ev, StepDone)]


@pytest.mark.parametrize("mode,thresholds", MODES, ids=[m for m, _ in MODES])
@pytest.mark.parametrize("retain_kv", [True, False])
def test_modes_equal_reference(pair, tok, mode, thresholds, retain_kv):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = mixed_prompts(8, seed=11)
    pol = DiscardTwoBack()
    with Router(pair, pol, tokenizer=tok, mode=mode, thresholds=thresholds, retain_kv=retain_kv) as r:
        outs = r.generate(prompts, sampling=params, concurrency=8, timeout=120)
        trace = list(r.trace)
        assert all(free == usable for free, usable in pools_free(r).values())
    for o in outs:
        ref = reference_generate(pair, o.prompt, pol, params, rid=o.rid)
        assert o.token_ids == ref["token_ids"] and o.token_models == ref["token_models"]
    assert sum(o.hops for o in outs) > 8
    steps = steps_of(trace)
    if not retain_kv:  # every return to a model re-prefills the whole context
        for o in outs:
            fed = [(s.model, s.fed[o.rid]) for s in steps if o.rid in s.fed]
            visits = [f for i, f in enumerate(fed) if i == 0 or fed[i - 1][0] != f[0]]
            assert all(n > 1 for _, n in visits[1:]), visits  # no visit starts with a 1-token extend
    if mode == "model_sync":  # one model at a time: no two steps overlap
        ss = sorted(steps, key=lambda s: s.t_start)
        assert all(a.t_end <= b.t_start for a, b in zip(ss, ss[1:]))
    if mode == "sync":  # global barrier: steps of round r all end before round r+1 starts
        rounds = {}
        for s in steps:
            rounds.setdefault(s.round, []).append(s)
        keys = sorted(rounds)
        for a, b in zip(keys, keys[1:]):
            assert max(s.t_end for s in rounds[a]) <= min(s.t_start for s in rounds[b])
        assert any(len(v) == 2 for v in rounds.values())  # both models stepped in one round


def test_delayed_batches_reach_threshold_until_the_tail(pair, tok):
    th = {"small": 4, "large": 3}
    with Router(pair, RandomRouting(p=0.3, seed=1), tokenizer=tok, mode="delayed", thresholds=th) as r:
        outs = r.generate(mixed_prompts(12, seed=2), max_new_tokens=20, ignore_eos=True, concurrency=8, timeout=120)
        trace = list(r.trace)
    assert all(o.finish_reason == "length" for o in outs)
    inflight, small_batches = 0, []
    for ev in trace:  # replay: a step below threshold is allowed only when the tail rule applies
        if isinstance(ev, Admitted):
            inflight += 1
        elif isinstance(ev, Finished):
            inflight -= 1
        elif isinstance(ev, StepDone):
            s = ev
            if s.batch_size < th[s.model]:
                assert inflight <= sum(b - 1 for b in th.values()) + 1, (s.model, s.batch_size, inflight)
            if s.model == "small":
                small_batches.append(s.batch_size)
    assert max(small_batches) >= 4


def test_infeasible_thresholds_are_refused(pair, tok):
    with Router(pair, RandomRouting(0.3), tokenizer=tok, mode="delayed", thresholds={"small": 4, "large": 3}) as r:
        with pytest.raises(ValueError, match=r"sum\(B_i - 1\) = 5 < N.*N = 4"):
            r.generate(mixed_prompts(4), max_new_tokens=4, concurrency=4)
    with pytest.raises(ValueError, match="unknown schedule mode"):
        Router(pair, tokenizer=tok, mode="fast")
    with pytest.raises(ValueError, match="thresholds"):
        Router(pair, tokenizer=tok, mode="delayed", thresholds={"medium": 2})


def test_no_deadlock_under_random_routing_and_thresholds(pair, tok):
    """Many seeds, thresholds and concurrencies: every request finishes (the generate timeout
    would raise on a deadlock)."""
    rng = random.Random(0)
    for trial in range(12):
        n = rng.randint(2, 10)
        b_small = rng.randint(1, n)
        b_large = rng.randint(1, max(1, n - b_small))  # sum(B - 1) < n
        p = rng.choice([0.05, 0.3, 0.7, 1.0])
        with Router(
            pair,
            RandomRouting(p=p, seed=trial),
            tokenizer=tok,
            mode="delayed",
            thresholds={"small": b_small, "large": b_large},
        ) as r:
            outs = r.generate(
                mixed_prompts(n + rng.randint(0, 5), seed=trial),
                max_new_tokens=rng.randint(1, 12),
                ignore_eos=True,
                concurrency=n,
                timeout=60,
            )
        assert all(o.finish_reason == "length" for o in outs), (trial, [o.error for o in outs])


@pytest.mark.parametrize("mode", ["sync", "model_sync", "delayed"])
def test_three_models_in_every_mode(trio, tok, mode):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    th = {"s": 2, "m": 2, "l": 2} if mode == "delayed" else None
    with Router(trio, Cycle3(), tokenizer=tok, mode=mode, thresholds=th) as r:
        outs = r.generate(mixed_prompts(6, seed=4), sampling=params, timeout=120)
    for o in outs:
        assert o.token_ids == reference_generate(trio, o.prompt, Cycle3(), params, rid=o.rid)["token_ids"]
