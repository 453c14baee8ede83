"""Tensor parallelism (`tokenrouter_sdk.backends.tensor_parallel`): the large model of the tiny
float64 pair at tp=2 (gloo on the CPU) writes exactly what the tp=1 run and the naive reference
write, with sub-servers in threads and in processes; abort and a failed request behave as in one
process; a killed rank makes its model dead (named) without a hang; heads that do not divide by
tp are refused with both numbers; every rank process is gone after close."""

import os
import signal
import time

import pytest
import torch

from tokenrouter_sdk import ModelSpec, Router, SamplingParams
from tokenrouter_sdk.backends.tensor_parallel import ModelRecipe, TensorParallelError, TensorParallelRunner
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.front.engine import EngineDeadError
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import tiny_model
from tokenrouter_sdk.policies import RandomRouting

from ..helpers import DiscardTwoBack, assert_matches_reference, mixed_prompts, process_gone

N_NEW = 16
pytestmark = pytest.mark.timeout(240)


def _wait_gone(pids, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(process_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _tp_pids(router) -> list[int]:
    r = router.engine.runners["large"]
    return r.pids() if isinstance(r, TensorParallelRunner) else []


def test_runner_logits_equal_unsharded_runner():
    m = tiny_model(num_layers=2, seed=3)
    tp = TensorParallelRunner(ModelRecipe(m), 2, max_kv_tokens=256, timeout_s=60, start=True)
    ref = TorchRunner(m, max_kv_tokens=256)
    try:
        assert tp.pool.k.shape[2] == 1 and ref.pool.k.shape[2] == 2  # local KV heads: 2 / tp
        a, b = [], []
        blocks_of(tp).ensure(a, 40)
        blocks_of(ref).ensure(b, 40)
        for seqs_a, seqs_b in (
            ([SeqInput(list(range(5, 20)), 0, a)], [SeqInput(list(range(5, 20)), 0, b)]),
            ([SeqInput([7, 8], 15, a)], [SeqInput([7, 8], 15, b)]),
            ([SeqInput([9], 17, a)], [SeqInput([9], 17, b)]),
        ):
            x = tp.forward(seqs_a).logits
            y = ref.forward(seqs_b).logits
            assert torch.allclose(x, y, rtol=0, atol=1e-10), (x - y).abs().max()
        pids = tp.pids()
    finally:
        tp.release()
        ref.release()
    assert pids and _wait_gone(pids)


def test_heads_that_do_not_divide_are_refused_with_both_numbers(pair, tok):
    with pytest.raises(TensorParallelError, match=r"KV heads \(2\).*divide by 3"):
        Router({"small": pair["small"], "large": ModelSpec(pair["large"], tp=3)}, tokenizer=tok, processes=False)
    with pytest.raises(ValueError, match="positive int"):
        Router(pair, tokenizer=tok, tp={"large": 0}, processes=False)
    with pytest.raises(ValueError, match="does not have"):
        Router(pair, tokenizer=tok, tp={"huge": 2}, processes=False)


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_routed_output_equals_tp1_and_reference(pair, tok, processes):
    prompts = mixed_prompts(6, seed=4)
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with Router(pair, DiscardTwoBack(), tokenizer=tok, processes=processes) as r1:
        want = r1.generate(prompts, sampling=params)
    r = Router(
        {"small": pair["small"], "large": ModelSpec(pair["large"], tp=2)},
        DiscardTwoBack(),
        tokenizer=tok,
        processes=processes,
    )
    try:
        pids = _tp_pids(r) if not processes else []
        got = r.generate(prompts, sampling=params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.token_models for o in got] == [o.token_models for o in want]
        assert sum(o.hops for o in got) > 0  # both models wrote
        assert_matches_reference(pair, got, DiscardTwoBack, params)
        # sampled, with handoffs both ways: the same as tp=1 with the same seeds
        sp = SamplingParams(max_new_tokens=N_NEW, temperature=0.8, seed=5, ignore_eos=True)
        a = r.generate(prompts[:3], sampling=sp, policy=RandomRouting(p=0.5, seed=1))
        with Router(pair, tokenizer=tok, processes=processes) as r1:
            b = r1.generate(prompts[:3], sampling=sp, policy=RandomRouting(p=0.5, seed=1))
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        # a failed request stays alone, an aborted call leaves the Router serving
        outs = r.generate([prompts[0], [10**6], prompts[1]], sampling=params)
        assert outs[1].error and not outs[0].error and outs[0].token_ids == want[0].token_ids
        assert r.kv_stats()  # every KV block came back: the stats read without error
    finally:
        r.close()
    assert not pids or _wait_gone(pids)


def test_killed_rank_makes_its_model_dead_without_a_hang(pair, tok):
    r = Router(
        {"small": pair["small"], "large": ModelSpec(pair["large"], tp=2)},
        tokenizer=tok,
        processes=False,
        policy=RandomRouting(p=1.0, seed=0),
    )
    try:
        pids = _tp_pids(r)
        params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
        assert not any(o.error for o in r.generate(mixed_prompts(2, seed=1), sampling=params))
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        outs = r.generate(mixed_prompts(3, seed=2), sampling=params, timeout=60)
        assert time.monotonic() - t0 < 30
        assert all(o.error for o in outs)
        assert any("large" in o.error for o in outs), [o.error for o in outs]
        with pytest.raises(EngineDeadError, match="large"):
            r.generate(mixed_prompts(1, seed=3), sampling=params, timeout=60)
    finally:
        r.close()
    assert _wait_gone(pids)
