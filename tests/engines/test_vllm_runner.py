"""vLLM's runner behind our seam (`tokenrouter_sdk.backends.vllm_runner`): its step computes what
the model computes, and routed generation over it (Router, policies, both transports, a pair
mixing it with our torch runner) equals the naive reference token for token until the
reference's first near-tie, with every log-probability within 1e-4 of the writer's
log-softmax (float32); every KV block comes back after a run, an abort and a KV-pressure run;
prefix-cache hits give the same tokens; a sub-server's death is reported."""

import importlib.util
import os
import signal
import time

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.placement import ModelSpec
from tokenrouter_sdk.policies import RandomRouting, RStitch
from tokenrouter_sdk.reference import reference_generate

from ..helpers import pools_free

pytestmark = [
    pytest.mark.engines,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: pip install 'tokenrouter-sdk[vllm]' runs this tier",
    ),
]

N_NEW = 20
PROMPT_LENS = (3, 16, 29, 41)  # shorter than, exactly, and across KV blocks of 16
POLICIES = {"random": lambda: RandomRouting(p=0.3, seed=5), "rstitch": lambda: RStitch(tau=0.66)}


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _near_tie(logits, tol=1e-4) -> bool:
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1]) < tol


def check_reference(ref_models, outs, policy_factory, params):
    """Tokens and writers equal the reference until its first near-tie; log-probabilities within
    1e-4 there; at least 4 tokens compared per request."""
    for o in outs:
        assert o.finish_reason == "length", o.error
        ref = reference_generate(ref_models, list(o.prompt), policy_factory(), params, rid=o.rid, key=o.key)
        n = 0
        for i, lg in enumerate(ref["logits"][: len(ref["token_ids"])]):
            if _near_tie(lg) or i >= len(o.token_ids):
                break
            assert o.token_ids[i] == ref["token_ids"][i] and o.token_models[i] == ref["token_models"][i], (o.rid, i)
            assert abs(o.logprobs[i] - ref["logprobs"][i]) < 1e-4, (o.rid, i, o.logprobs[i], ref["logprobs"][i])
            n += 1
        assert n >= 4, f"request {o.rid}: a near-tie at token {n}: the float32 check compared too little"


def _all_free(r):
    free = pools_free(r, timeout=30)
    assert all(f == n for f, n in free.values()), free


def test_step_equals_the_models_forward(tiny_folders, reference_models):
    """Prefill, decode and extend steps on scattered block ids, and a request that starts on
    another one's first block (a prefix hit): logits, hidden states and fed hidden states equal
    transformers' forward over the whole sequence."""
    from tokenrouter_sdk.backends.vllm_runner import VLLMRunnerSpec

    ref = reference_models["qwen2"]["large"]
    runner = VLLMRunnerSpec(tiny_folders["qwen2"]["large"], max_kv_tokens=512, block_size=16).build()
    try:
        assert (runner.pool.num_blocks, runner.pool.block_size, runner.vocab_size) == (32, 16, 259)
        assert runner.dtype == torch.float32 and runner.max_context == 1024
        prompts = _prompts(1)[1:]
        tables = [[7, 2, 30], [4, 5, 6, 9], [11, 12, 13, 14, 15]]
        seqs = [[list(p)] for p in prompts]

        def check(out, asked=()):
            with torch.no_grad():
                for i, s in enumerate(seqs):
                    o = ref(torch.tensor([s[0]]), output_hidden_states=True)
                    h = o.hidden_states[-1][0]
                    torch.testing.assert_close(out.logits[i], o.logits[0, -1], atol=1e-4, rtol=0)
                    torch.testing.assert_close(out.hidden[i], h[-1], atol=1e-4, rtol=0)
                    if i in asked:
                        n = out.fed_hidden[i].shape[0]
                        torch.testing.assert_close(out.fed_hidden[i], h[-n:], atol=1e-4, rtol=0)
                    elif out.fed_hidden is not None:
                        assert out.fed_hidden[i] is None

        check(
            runner.forward([SeqInput(p, 0, t, all_hidden=i == 1) for i, (p, t) in enumerate(zip(prompts, tables))]),
            asked=(1,),
        )
        for step in ([5], [6, 7, 8, 9, 10], [11]):  # decode, extend, decode
            starts = [len(s[0]) for s in seqs]
            for s in seqs:
                s[0] += step
            out = runner.forward(
                [SeqInput(step, st, t, all_hidden=i == 0) for i, (st, t) in enumerate(zip(starts, tables))]
            )
            check(out, asked=(0,))
        # a request sharing the first block of the second one (same 16 tokens) feeds only its suffix
        shared = seqs[1][0][:16] + [40, 41, 42]
        out = runner.forward([SeqInput([40, 41, 42], 16, [tables[1][0], 20])])
        with torch.no_grad():
            torch.testing.assert_close(out.logits[0], ref(torch.tensor([shared])).logits[0, -1], atol=1e-4, rtol=0)
    finally:
        runner.release()
    assert runner.pool.layers is None
    with pytest.raises(RuntimeError, match="released"):
        runner.forward([SeqInput([3], 0, [0])])


def _routed(models, ref_models, processes, *, prefix=False):
    """Both policies, greedy with log-probabilities, concurrency 4, through one Router; the
    Router is returned open (the caller closes it)."""
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, logprobs=0)
    r = Router(models, RandomRouting(), max_kv_tokens=1024, processes=processes)
    try:
        for name, policy in POLICIES.items():
            outs = r.generate(_prompts(), sampling=params, policy=policy(), concurrency=4, timeout=120)
            assert {m for o in outs for m in o.token_models} == {"small", "large"}, name
            check_reference(ref_models, outs, policy, params)
            _all_free(r)
            if prefix and name == "random":  # the same prompts again: prefix-cache hits, the same tokens
                again = r.generate(_prompts(), sampling=params, policy=policy(), concurrency=4, timeout=120)
                assert [o.token_ids for o in again] == [o.token_ids for o in outs]
                assert r.kv_stats()["large"].prefix_hit_tokens > 0
                _all_free(r)
    except BaseException:
        r.close()
        raise
    return r


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_routed_vllm_pair_equals_the_reference(tiny_folders, reference_models, arch, processes):
    models = {n: ModelSpec(f, runner="vllm") for n, f in tiny_folders[arch].items()}
    r = _routed(models, reference_models[arch], processes, prefix=not processes)
    with r:
        assert r.engine.runners["large"].impl == "vllm"
        # score(): teacher-forced log-probabilities equal the reference's for the same routing
        prompts, conts = _prompts(3)[:2], [[5, 6, 7, 8, 9, 10], [70, 71, 72, 73]]
        scored = r.score(prompts, conts, policy=RandomRouting(p=0.5, seed=2), timeout=60)
        for p, c, o in zip(prompts, conts, scored):
            ref = reference_generate(
                reference_models[arch],
                p,
                RandomRouting(p=0.5, seed=2),
                SamplingParams(max_new_tokens=len(c), ignore_eos=True),
                rid=o.rid,
                key=o.key,
                forced=c,
            )
            assert o.token_ids == c and o.token_models == ref["token_models"]
            assert o.logprobs == pytest.approx(ref["logprobs"], abs=1e-4)
        _all_free(r)
        if processes:  # a sub-server's death: its requests fail, the model is reported dead
            call = r.submit([[3, 4, 5]], max_new_tokens=400, ignore_eos=True, policy=RandomRouting(p=0.5, seed=1))
            while len(call[0].output.token_ids) < 3:
                time.sleep(0.002)
            os.kill(r.engine.transport.pids()["large"], signal.SIGKILL)
            call.wait(60)
            assert call[0].output.finish_reason == "failed" and "'large'" in call[0].output.error
            assert not r.kv_stats(timeout=30)["large"].alive


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_mixed_pair_small_on_ours_large_on_vllm(tiny_folders, reference_models, processes):
    folders = tiny_folders["llama"]
    models = {"small": ModelSpec(folders["small"]), "large": ModelSpec(folders["large"], runner="vllm")}
    with _routed(models, reference_models["llama"], processes) as r:
        assert getattr(r.engine.runners["small"], "impl", "torch") != "vllm"
        assert r.engine.runners["large"].impl == "vllm"


def test_abort_and_kv_pressure_give_every_block_back(tiny_folders):
    models = {n: ModelSpec(f, runner="vllm") for n, f in tiny_folders["llama"].items()}
    with Router(models, RandomRouting(p=0.5, seed=1), max_kv_tokens=64) as r:
        assert {m: s.num_blocks for m, s in r.kv_stats().items()} == {"small": 4, "large": 4}
        call = r.submit([[3, 4, 5], [6, 7]], max_new_tokens=40, ignore_eos=True)
        while len(call[0].output.token_ids) < 5:
            time.sleep(0.002)
        r.abort(call)
        call.wait(30)
        assert [h.output.finish_reason for h in call] == ["aborted", "aborted"]
        _all_free(r)
        outs = r.generate([[7] * 50, [5, 6]], max_new_tokens=100, ignore_eos=True, timeout=60)
        assert outs[0].finish_reason == "failed" and "KV pool" in outs[0].error
        assert outs[1].finish_reason == "failed" or outs[1].ok
        _all_free(r)
        assert r.generate([3, 4], max_new_tokens=4, ignore_eos=True, timeout=60).ok
        _all_free(r)


def test_settings_that_do_not_apply_are_refused_before_anything_loads(tiny_folders):
    folder = tiny_folders["llama"]["large"]
    with pytest.raises(ValueError, match="multiple of 16"):
        Router(
            {"small": ModelSpec(folder, runner="vllm"), "large": ModelSpec(folder, runner="vllm")},
            RandomRouting(),
            block_size=8,
        )
    with pytest.raises(ValueError, match="tp=2"):
        Router({"small": ModelSpec(folder), "large": ModelSpec(folder, runner="vllm", tp=2)}, RandomRouting())
    with pytest.raises(ValueError, match="engine_args may not set"):
        Router(
            {"small": ModelSpec(folder), "large": ModelSpec(folder, runner="vllm", engine_args={"dtype": "half"})},
            RandomRouting(),
        )
