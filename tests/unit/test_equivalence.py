"""The engine's greedy tokens equal a naive reference that recomputes
the whole prefix on every step and applies the same policy."""

import pytest
import torch

from tokenrouter_sdk import Needs, Router, SamplingParams
from tokenrouter_sdk.policies import LargeOnly, RandomRouting, RStitch, SingleModel, SmallOnly
from tokenrouter_sdk.reference import reference_generate

from ..helpers import Cycle3, DiscardTwoBack, KeepEveryThird, mixed_prompts, pools_free

N_NEW = 24


def run_and_compare(models, tok, policy, prompts, concurrency, min_hops=1):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with Router(models, policy, tokenizer=tok, max_kv_tokens=8192) as r:
        outs = r.generate(prompts, sampling=params, concurrency=concurrency)
        assert all(free == usable for free, usable in pools_free(r).values())
    total_hops = 0
    for o in outs:
        assert o.finish_reason == "length", o.error
        ref = reference_generate(models, o.prompt, policy, params, rid=o.rid)
        assert o.token_ids == ref["token_ids"], f"rid {o.rid}"
        assert o.token_models == ref["token_models"]
        assert (o.hops, o.discarded) == (ref["hops"], ref["discarded"])
        assert len(o.token_ids) == N_NEW
        total_hops += o.hops
    assert total_hops >= min_hops, "the policy never handed off: the test would not exercise handoffs"
    return outs


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize(
    "name", ["small_only", "large_only", "single_large", "random", "rstitch", "rstitch_maxprob", "keep", "discard"]
)
def test_two_model_policies(pair, tok, name, concurrency):
    policy = {
        "small_only": SmallOnly(),
        "large_only": LargeOnly(),
        "single_large": SingleModel("large"),
        "random": RandomRouting(p=0.3, seed=3),
        "rstitch": RStitch(tau=0.79),
        "rstitch_maxprob": RStitch(tau=0.1, signal="max_prob"),
        "keep": KeepEveryThird(),
        "discard": DiscardTwoBack(),
    }[name]
    single = name in ("small_only", "large_only", "single_large")
    outs = run_and_compare(
        pair, tok, policy, mixed_prompts(8, seed=concurrency), concurrency, min_hops=0 if single else 4
    )
    if single:
        want = "small" if name == "small_only" else "large"
        assert all(set(o.token_models) == {want} and o.hops == 0 for o in outs)
    else:
        writers = {m for o in outs for m in o.token_models}
        assert writers == {"small", "large"}


@pytest.mark.parametrize("concurrency", [1, 8])
def test_three_models(trio, tok, concurrency):
    outs = run_and_compare(trio, tok, Cycle3(), mixed_prompts(8, seed=5), concurrency, min_hops=8)
    assert {m for o in outs for m in o.token_models} == {"s", "m", "l"}
    assert sum(o.discarded for o in outs) > 0


def test_logits_match_reference_within_tolerance(pair, tok):
    """Logits of each engine step agree with the full recompute (float64; RoPE runs in fp32)."""
    seen = []

    class Record(DiscardTwoBack):  # route runs on every step (no forced spans)
        needs = Needs(logits=True)

        def route(self, step):
            seen.append((step.request.rid, step.model, step.position, step.logits.clone()))
            return super().route(step)

    pol = Record()
    prompts = mixed_prompts(4, seed=9)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    with Router(pair, pol, tokenizer=tok) as r:
        outs = r.generate(prompts, sampling=params)
    for o in outs:
        ref = reference_generate(pair, o.prompt, DiscardTwoBack(), params, rid=o.rid)
        mine = [lg for rid, m, pos, lg in seen if rid == o.rid]
        assert len(mine) == len(ref["logits"])
        for a, b in zip(mine, ref["logits"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_single_model_equals_transformers_generate(pair, tok):
    large = pair["large"]
    prompts = mixed_prompts(4, seed=2)
    with Router({"large": large}, SingleModel("large"), tokenizer=tok) as r:
        outs = r.generate(prompts, max_new_tokens=16)
    for p, o in zip(prompts, outs):
        g = large.generate(
            torch.tensor([p]),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        assert o.token_ids == g[0, len(p) :].tolist()
