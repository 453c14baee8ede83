"""Compiled steps on the packaged pair (SmolLM2-135M-Instruct and its self-draft, fp32): the
compiled forward's logits equal the eager forward's within fp32 tolerance for prefill, decode and
extend, and routed generation with compile on writes the eager run's tokens (handoffs both ways).
Each model compiles once in this process (tens of seconds to minutes on two cores; inductor's disk
cache makes later runs warm), so one module-scoped pair of runners serves every check."""

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import default_pair
from tokenrouter_sdk.policies import RandomRouting

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
FP32 = dict(rtol=0, atol=2e-3)  # logits of order 10: fp32 reassociation of 30 layers of fused kernels


@pytest.fixture(scope="module")
def pair_and_tok():
    large, small, tok = default_pair()
    return {"small": small, "large": large}, tok


def test_compiled_logits_equal_eager_on_the_packaged_model(pair_and_tok):
    models, tok = pair_and_tok
    for name in ("large", "small"):
        eager = TorchRunner(models[name], max_kv_tokens=1024)
        comp = TorchRunner(models[name], max_kv_tokens=1024, compile="wait")
        assert comp.wait_compiled(), comp.compile_error
        prompts = [tok("What is 7 + 5?")["input_ids"], tok("Name a planet that has rings.")["input_ids"]]
        te, tc = [[], []], [[], []]
        for t in te:
            blocks_of(eager).ensure(t, 64)
        for t in tc:
            blocks_of(comp).ensure(t, 64)
        starts = [0, 0]
        for feed in (prompts, [[11], [12]], [[13, 14, 15], [16]]):  # prefill, decode, extend + decode
            le, _, _ = eager.forward([SeqInput(f, s, t) for f, s, t in zip(feed, starts, te)])
            lc, _, _ = comp.forward([SeqInput(f, s, t) for f, s, t in zip(feed, starts, tc)])
            assert comp.last_compiled
            torch.testing.assert_close(lc, le, **FP32)
            assert (lc.argmax(-1) == le.argmax(-1)).all()
            starts = [s + len(f) for s, f in zip(starts, feed)]


def test_routed_generation_compiled_equals_eager(pair_and_tok):
    models, tok = pair_and_tok
    policy = RandomRouting(p=0.4, seed=2)
    prompts = ["What is 7 + 5?", "Name a planet.", "Janet has 3 apples and buys 4 more. How many?"]
    runs = {}
    for compile in (False, "wait"):
        with Router(models, policy, tokenizer=tok, compile=compile, processes=False) as r:
            outs = r.generate(prompts, max_new_tokens=24, ignore_eos=True, concurrency=3)
            if compile:
                assert all(run.last_compiled for run in r.engine.runners.values())
        runs[compile] = [(o.token_ids, o.token_models) for o in outs]
        hops = sum(o.hops for o in outs)
    assert runs[False] == runs["wait"] and hops >= 4
