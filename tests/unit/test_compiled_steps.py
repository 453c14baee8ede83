"""Compiled steps (`TorchRunner(compile=...)`, `tokenrouter_sdk.backends.compiled_step`): the
forward compiled by torch.compile gives the eager step's logits, hidden states and K/V for
prefills, decodes, extends and mixed batches (one request, padding included), and routed
generation with compile on equals the naive reference in threads and processes.

Compiles are slow on two cores (tens of seconds per model), so every test uses the session's
float64 ``pair`` and one compiled forward per model object is shared by all the runners of the
process: the first test that compiles a model pays (the cold path), every later runner and
Router of the same model reuses it (the warm path, asserted in
`test_second_router_reuses_the_compiled_forward`). Tolerance: float64 models, but transformers
computes the rotary cos/sin in float32 and inductor skips the intermediate float32 rounding, so
logits agree to about 1e-6, not 1e-12.
"""

import pickle
import random
import time

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.config import EngineConfig
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate

from ..helpers import DiscardTwoBack, mixed_prompts

pytestmark = pytest.mark.timeout(600)
ATOL = 1e-5


def _tables(runner, lens, extra=60):
    tables = [[] for _ in lens]
    for t, n in zip(tables, lens):
        blocks_of(runner).ensure(t, n + extra)
    return tables


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_compiled_steps_equal_eager_steps(pair, impl):
    """Prefill, decode, extend (a return after a handoff) and mixed batches of 1 to 5 requests:
    the compiled step's logits and hidden states equal the eager step's, the K/V written to every
    request slot too, and no step after the first recompiles; for the native forward (its
    projections and attention as custom ops, the rest fused) and the transformers one."""
    large = pair["large"]
    eager = TorchRunner(large, max_kv_tokens=4096, model_impl=impl)
    comp = TorchRunner(large, max_kv_tokens=4096, compile="wait", model_impl=impl)
    assert comp.wait_compiled() and comp.compile_error is None
    assert comp._compiled.native == (impl == "auto")
    rng = random.Random(1)
    steps = 0
    for b in (1, 2, 5):
        prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 40))] for _ in range(b)]
        lens = [len(p) for p in prompts]
        te, tc = _tables(eager, lens), _tables(comp, lens)
        feeds = [prompts] + [
            [[rng.randrange(3, 250) for _ in range(rng.choice([1, 1, 3, 9]))] for _ in range(b)] for _ in range(3)
        ]
        starts = [0] * b
        for feed in feeds:
            le, he, _ = eager.forward([SeqInput(f, s, t) for f, s, t in zip(feed, starts, te)])
            t0 = time.perf_counter()
            lc, hc, _ = comp.forward([SeqInput(f, s, t) for f, s, t in zip(feed, starts, tc)])
            assert time.perf_counter() - t0 < 5, "a compiled step recompiled"
            assert comp.last_compiled and comp.last_impl == "compiled" and lc.shape == le.shape == (b, eager.vocab_size)
            torch.testing.assert_close(lc, le, rtol=0, atol=ATOL)
            torch.testing.assert_close(hc, he, rtol=0, atol=ATOL)
            starts = [s + len(f) for s, f in zip(starts, feed)]
            steps += 1
        for n, a, c in zip(starts, te, tc):
            se, sc = eager.pool.slots(a, 0, n), comp.pool.slots(c, 0, n)
            torch.testing.assert_close(comp.pool.k[:, sc], eager.pool.k[:, se], rtol=0, atol=ATOL)
            torch.testing.assert_close(comp.pool.v[:, sc], eager.pool.v[:, se], rtol=0, atol=ATOL)
            blocks_of(eager).free(a)
            blocks_of(comp).free(c)
    assert steps == 12


def test_prompt_hidden_states_from_a_compiled_step(pair):
    """``all_hidden`` inputs get every fed position's hidden state from the compiled step too."""
    large = pair["large"]
    eager, comp = TorchRunner(large, max_kv_tokens=512), TorchRunner(large, max_kv_tokens=512, compile="wait")
    te, tc = _tables(eager, [7, 3]), _tables(comp, [7, 3])
    feed = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    oe = eager.forward([SeqInput(feed[0], 0, te[0], all_hidden=True), SeqInput(feed[1], 0, te[1])])
    oc = comp.forward([SeqInput(feed[0], 0, tc[0], all_hidden=True), SeqInput(feed[1], 0, tc[1])])
    assert comp.last_compiled and oc[2][1] is None and oc[2][0].shape == (7, oe[1].shape[1])
    torch.testing.assert_close(oc[2][0], oe[2][0], rtol=0, atol=ATOL)


def test_second_router_reuses_the_compiled_forward(pair, tok):
    """The warm path: a second Router (and a plain runner) over the same model objects takes the
    compiled forward the first one built in this process; its first step compiles nothing."""
    with Router(pair, DiscardTwoBack(), tokenizer=tok, compile="wait", processes=False) as r1:
        r1.generate([[5, 6, 7]], max_new_tokens=4, ignore_eos=True)
        first = {m: run._compiled for m, run in r1.engine.runners.items()}
    assert all(cf is not None and cf.ready.is_set() for cf in first.values())
    with Router(pair, DiscardTwoBack(), tokenizer=tok, compile="wait", processes=False) as r2:
        t0 = time.perf_counter()
        r2.generate([[5, 6, 7]], max_new_tokens=4, ignore_eos=True)
        assert time.perf_counter() - t0 < 10  # a compile of either model takes longer on two cores
        assert {m: run._compiled for m, run in r2.engine.runners.items()} == first


def test_background_compile_serves_eager_steps_until_ready(pair, tok):
    """``compile=True``: the first step does not wait; once the compile is in, steps are compiled.
    The routed tokens equal the naive reference whichever steps ran compiled."""
    from tokenrouter_sdk.models import tiny_model

    # never compiled in this process, and of a depth no other test compiles (dynamo reuses a graph
    # compiled for another model of the same class and shapes): a cold compile
    fresh = tiny_model(num_layers=3, seed=21)
    runner = TorchRunner(fresh, max_kv_tokens=512, compile=True)
    t = _tables(runner, [3])[0]
    t0 = time.perf_counter()
    runner.forward([SeqInput([3, 4, 5], 0, t)])
    assert time.perf_counter() - t0 < 5 and not runner.last_compiled  # eager while compiling
    assert runner.wait_compiled(timeout=500)
    runner.forward([SeqInput([6], 3, t)])
    assert runner.last_compiled and runner.compile_s > 0


def test_hooks_make_a_compiled_native_step_run_transformers(pair):
    """An activation hook on a module the native forward does not call: the compiled native
    step is skipped for the transformers forward (eager), so the hook runs; removed, steps are
    compiled again."""
    large = pair["large"]
    comp = TorchRunner(large, max_kv_tokens=512, compile="wait")
    plain = TorchRunner(large, max_kv_tokens=512, model_impl="transformers")
    assert comp.wait_compiled() and comp._compiled.native
    calls = []
    h = large.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: calls.append(1) or out * 0.5)
    try:
        lc = comp.forward([SeqInput([5, 6, 7], 0, _tables(comp, [3])[0])]).logits
        lp = plain.forward([SeqInput([5, 6, 7], 0, _tables(plain, [3])[0])]).logits
        assert comp.last_impl == "transformers" and len(calls) == 2
        torch.testing.assert_close(lc, lp, rtol=0, atol=0)
    finally:
        h.remove()
    comp.forward([SeqInput([5, 6, 7], 0, _tables(comp, [3])[0])])
    assert comp.last_impl == "compiled"


def test_compile_setting_is_checked():
    with pytest.raises(ValueError, match="compile must be"):
        EngineConfig(compile="sometimes")
    with pytest.raises(ValueError, match="compile must be"):
        TorchRunner(torch.nn.Linear(1, 1), compile="yes")  # checked before the model is read


def test_runner_pickles_without_compiled_code(pair):
    r = TorchRunner(pair["large"], max_kv_tokens=256, compile="wait")
    assert r.wait_compiled()
    clone = pickle.loads(pickle.dumps(r))
    assert clone._compiled is None and clone.compile == "wait" and not clone._compile_started
    assert "_tokenrouter_compiled" in pair["large"].__dict__
    assert pickle.loads(pickle.dumps(pair["large"])).__dict__["_tokenrouter_compiled"].forwards == {}


@pytest.mark.parametrize("mode,processes", [("async", False), ("sync", False), ("async", True)])
def test_routed_generation_with_compile_equals_reference(pair, tok, mode, processes):
    """Invariant 5 with compiled steps: prefills, decodes and the extends of returns after
    handoffs both ways, exactly the naive reference's tokens, in threads and in processes (the
    sub-server processes compile their own; inductor's on-disk cache makes that warm)."""
    policy = DiscardTwoBack() if mode == "async" else RandomRouting(p=0.3, seed=3)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = mixed_prompts(6, seed=5)
    with Router(pair, policy, tokenizer=tok, mode=mode, compile="wait", processes=processes) as r:
        outs = r.generate(prompts, sampling=params, concurrency=6)
        if not processes:
            assert all(run.last_compiled for run in r.engine.runners.values())
    hops = 0
    for o in outs:
        assert o.finish_reason == "length", o.error
        ref = reference_generate(pair, o.prompt, policy, params, rid=o.rid)
        assert o.token_ids == ref["token_ids"] and o.token_models == ref["token_models"]
        hops += o.hops
    assert hops >= 4


def test_bf16_weights_compiled_within_bf16_tolerance():
    """bf16 weights and KV (avx512_bf16/AMX CPUs): the compiled step stays within bf16 rounding of
    the eager bf16 step and both within 0.1 of the fp32 step's logit spread (the stated bf16
    tolerance; inductor keeps fused intermediates in float32 where the eager step rounds each op
    to bf16, so the two bf16 steps differ by up to about 0.05-0.1 of the spread); argmax
    agreement is not promised at bf16."""
    from tokenrouter_sdk.models import tiny_model

    m32 = tiny_model(num_layers=2, seed=31, dtype=torch.float32)
    m16 = tiny_model(num_layers=2, seed=31, dtype=torch.bfloat16)
    r32, e16 = TorchRunner(m32, max_kv_tokens=256), TorchRunner(m16, max_kv_tokens=256)
    c16 = TorchRunner(m16, max_kv_tokens=256, compile="wait")
    assert c16.wait_compiled(), c16.compile_error
    feeds = [[[3, 4, 5, 6, 7], [8, 9]], [[10], [11]], [[12, 13], [14]]]
    tabs = {id(r): _tables(r, [5, 2]) for r in (r32, e16, c16)}
    starts = [0, 0]
    for feed in feeds:
        out = {
            id(r): r.forward([SeqInput(f, s, t) for f, s, t in zip(feed, starts, tabs[id(r)])])[0].float()
            for r in (r32, e16, c16)
        }
        spread = out[id(r32)].std().item()
        assert c16.last_compiled and c16.dtype == torch.bfloat16
        assert (out[id(c16)] - out[id(e16)]).abs().max().item() <= 0.1 * spread
        assert (out[id(c16)] - out[id(r32)]).abs().max().item() <= 0.1 * spread
        starts = [s + len(f) for s, f in zip(starts, feed)]


def test_compiled_steps_honour_windows_and_softcaps(tok):
    """Compiled steps of a windowed, soft-capped model (Gemma 2: the transformers forward
    compiled and frozen; the native forward compiles the same attention op): routed tokens and
    log-probabilities equal the naive reference on an untouched copy (the custom attention op
    reads each layer's window, soft-cap and scale from the step; the runner applies the
    final-logit soft-cap)."""
    import copy

    from tokenrouter_sdk.models import tiny_model, truncate

    large = tiny_model(
        arch="gemma2",
        num_layers=2,
        seed=41,
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        initializer_range=0.5,
    )
    models = {"small": truncate(large, 1), "large": large}
    ref = copy.deepcopy(models)
    policy = RandomRouting(p=0.3, seed=3)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=0)
    with Router(models, policy, tokenizer=tok, compile="wait", processes=False) as r:
        outs = r.generate(mixed_prompts(4, seed=6), sampling=params, concurrency=4)
        assert all(run.last_compiled for run in r.engine.runners.values())
    for o in outs:
        want = reference_generate(ref, o.prompt, policy, params, rid=o.rid)
        assert o.token_ids == want["token_ids"] and o.token_models == want["token_models"]
        assert o.logprobs == pytest.approx(want["logprobs"], abs=1e-5)
