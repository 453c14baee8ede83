"""The engine on the real packaged pair (SmolLM2-135M-Instruct and its first 10 layers)."""

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.backends.attention import use_paged_attention
from tokenrouter_sdk.models import default_pair
from tokenrouter_sdk.policies import LargeOnly, RandomRouting, RStitch
from tokenrouter_sdk.reference import reference_generate
from tokenrouter_sdk.request import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [
    "What is 7 + 5?",
    "Name a planet.",
    "Write one sentence about the ocean.",
    "Janet has 3 apples and buys 4 more. How many apples does she have?",
]


@pytest.fixture(scope="module")
def real_pair():
    large, small, tok = default_pair(small_layers=10)
    return large, small, tok


def test_large_only_equals_transformers_generate(real_pair):
    large, small, tok = real_pair
    with Router({"small": small, "large": large}, LargeOnly(), tokenizer=tok) as r:
        outs = r.generate(PROMPTS, max_new_tokens=32)
        ids = [r.encode(p) for p in PROMPTS]
    large.set_attn_implementation("sdpa")
    try:
        for p, o in zip(ids, outs):
            g = large.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
            assert o.token_ids == g[0, len(p) :].tolist()
            assert set(o.token_models) == {"large"}
    finally:
        use_paged_attention(large)
    assert "12" in outs[0].text


def test_rstitch_routes_and_matches_reference(real_pair):
    large, small, tok = real_pair
    models = {"small": small, "large": large}
    pol = RStitch(tau=0.1)
    with Router(models, pol, tokenizer=tok) as r:
        outs = r.generate(PROMPTS[:2], max_new_tokens=24, ignore_eos=True)
        m = r.metrics()
        ids = [r.encode(p) for p in PROMPTS[:2]]
    for p, o in zip(ids, outs):
        ref = reference_generate(
            models, p, RStitch(tau=0.1), SamplingParams(max_new_tokens=24, ignore_eos=True), rid=o.rid
        )
        assert o.token_ids == ref["token_ids"] and o.token_models == ref["token_models"]
    assert m.committed_tokens == 48 and m.hops > 0 and 0 < m.large_fraction < 1
    assert set(m.per_model) == {"small", "large"}


def test_router_default_quickstart():
    with Router.default(policy=RandomRouting(p=0.5, seed=0)) as router:
        outs = router.generate(["What is 7 + 5?", "Name a planet."], max_new_tokens=16)
        m = router.metrics()
    assert all(o.ok and o.text for o in outs)
    assert all(len(o.token_models) == len(o.token_ids) for o in outs)
    assert {"small", "large"} <= {x for o in outs for x in o.token_models}
    assert m.throughput_tok_s > 0 and m.hop_rate > 0


def test_prefix_cache_keeps_outputs_on_the_packaged_pair():
    """A shared system prompt on the packaged pair (processes, R-Stitch handing off both ways): the
    same tokens with the cache as without it, over two calls; the second call reuses the first's
    prompts on both models."""
    system = (
        "You are a careful assistant. Think step by step, check each step, and end with the "
        "final answer on its own line. "
    ) * 3
    prompts = [system + q for q in PROMPTS]
    runs = {}
    for cache in (False, True):
        with Router.default(policy=RStitch(tau=0.3, tau_back=0.02), prefix_cache=cache) as r:
            first = r.generate(prompts, chat=False, max_new_tokens=24, ignore_eos=True, concurrency=2)
            second = r.generate(prompts, chat=False, max_new_tokens=24, ignore_eos=True)
            runs[cache] = (first, second, r.kv_stats())
    (a1, a2, _), (b1, b2, st) = runs[False], runs[True]
    for x, y in zip(list(a1) + list(a2), list(b1) + list(b2)):
        assert (x.token_ids, x.token_models) == (y.token_ids, y.token_models)
    assert sum(o.hops for o in b1) > 0
    m1, m2 = b1.metrics().per_model, b2.metrics().per_model
    assert m1["large"].prefix_hit_tokens > 0 and m2["small"].prefix_hit_rate > 0.8
    assert st["small"].cached_blocks > 0 and st["large"].hit_rate > 0
