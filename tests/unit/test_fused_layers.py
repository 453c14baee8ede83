"""Decoder layers in one C++ call, or three around the Python attention, and every layer of a
step in one call (`tokenrouter_sdk.backends.fused_layers`): on every architecture with a native
forward (Llama, Mistral with its window, Qwen2 with q/k/v biases and windows, Qwen3 with q/k
norms), a float32 step computes the same bits fused as with the Python layer loop (logits and the
K/V written), whether the paged kernel attends every request (one call for the whole stack, or
one a layer when core lending runs between layers) or prefills and extends go to the gather
backend (three a layer); a layer whose projection runs another GEMM path runs the loop, and
``TOKENROUTER_FUSED_LAYERS=0`` turns it off."""

import random

import pytest
import torch

from tokenrouter_sdk.backends import autotune as A
from tokenrouter_sdk.backends import cpu_kernels, fused_layers
from tokenrouter_sdk.backends.attention import cpu_kernel, kernel_choice
from tokenrouter_sdk.backends.autotune import PackRule
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import tiny_model

pytestmark = pytest.mark.skipif(
    cpu_kernels.paged_attention_op(wait=True, timeout=600) is None, reason="the C++ CPU kernels could not be built here"
)

ARCHS = {
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral", sliding_window=6),
    "qwen2": dict(arch="qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "qwen3": dict(arch="qwen3"),
}


class Counted(list):
    """Per layer run through `LayerCalls`, whether it ran fused (True) or was left to the loop;
    ``stacks``: the steps whose every layer ran in one `LayerCalls.run_stack` call."""

    stacks = 0

    def clear(self):
        super().clear()
        self.stacks = 0


@pytest.fixture
def counted(monkeypatch):
    """`Counted` over `LayerCalls.run` (one entry a call) and `LayerCalls.run_stack` (one True a
    layer when it ran them; nothing when it left them to `run`)."""
    calls = Counted()
    real, real_stack = fused_layers.LayerCalls.run, fused_layers.LayerCalls.run_stack

    def run(self, *a):
        y = real(self, *a)
        calls.append(y is not None)
        return y

    def run_stack(self, *a):
        y = real_stack(self, *a)
        if y is not None:
            calls.extend([True] * len(self.layers))
            calls.stacks += 1
        return y

    monkeypatch.setattr(fused_layers.LayerCalls, "run", run)
    monkeypatch.setattr(fused_layers.LayerCalls, "run_stack", run_stack)
    return calls


def _runner(arch, monkeypatch, layers=3, kernel_extend=cpu_kernel.MAX_QUERIES):
    monkeypatch.setenv("TOKENROUTER_PACKING", "skinny")
    monkeypatch.setenv(kernel_choice.ENV, str(kernel_extend))  # the longest extend the paged kernel attends
    model = tiny_model(num_layers=layers, seed=21, dtype=torch.float32, initializer_range=0.5, **ARCHS[arch])
    g = torch.Generator().manual_seed(3)
    for m in model.modules():  # transformers starts biases at zero: give Qwen2's q/k/v biases values
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    for j, m in enumerate(m for m in model.modules() if hasattr(m, "variance_epsilon")):
        m.variance_epsilon = 0.05 * (j % 5) + 1e-6  # each norm its own epsilon: a mixed-up list shows
    r = TorchRunner(model, max_kv_tokens=1024, kernels="wait")
    r.prepare_steps()  # the native forward with its few-row weights, before the first step
    assert r._native._layer_calls is not None or not fused_layers.enabled()
    return r


def _both_ways(r, seqs):
    """The step computed with the fused calls, then again with the loop from the same KV state
    (it writes the same slots): (fused logits, loop logits, K/V after each)."""
    nf = r._native
    calls = nf._layer_calls
    a = r.forward(seqs).logits
    kv_a = (r.pool.k.clone(), r.pool.v.clone())
    nf._layer_calls = None
    try:
        b = r.forward(seqs).logits
    finally:
        nf._layer_calls = calls
    return a, b, kv_a, (r.pool.k.clone(), r.pool.v.clone())


@pytest.mark.parametrize("kernel_extend", [16, 1])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_layers_equal_the_layer_loop_bit_for_bit(arch, kernel_extend, monkeypatch, counted):
    """Prefills, then decodes and extends of 2-9 tokens at contexts crossing the window, batches
    of 1-5: the same logits and the same K/V, every layer of every step fused. With the kernel
    taking extends of up to 16 tokens, steps after the prefill are one call for all layers; with
    1, extends and prefills are attended over gathered copies between two calls a layer."""
    r = _runner(arch, monkeypatch, kernel_extend=kernel_extend)
    rng = random.Random(5)
    b = 5
    tabs = [[] for _ in range(b)]
    starts = [0] * b
    whole = []
    real = fused_layers.LayerCalls.mode
    monkeypatch.setattr(
        fused_layers.LayerCalls, "mode", staticmethod(lambda fb: whole.append(real(fb) == "whole") or real(fb))
    )
    steps = 0
    for step in range(9):
        live = list(range(b)) if step % 3 else rng.sample(range(b), rng.randint(1, b))
        if step == 0:
            live = list(range(b))
        feed = {
            i: [rng.randrange(3, 250) for _ in range(rng.randint(3, 20) if step == 0 else rng.choice([1, 1, 2, 9]))]
            for i in live
        }
        for i in live:
            blocks_of(r).ensure(tabs[i], starts[i] + len(feed[i]))
        seqs = [SeqInput(feed[i], starts[i], tabs[i]) for i in live]
        fused, loop, kv_fused, kv_loop = _both_ways(r, seqs)
        assert torch.equal(fused, loop), (arch, step, (fused - loop).abs().max())
        assert torch.equal(kv_fused[0], kv_loop[0]) and torch.equal(kv_fused[1], kv_loop[1])
        for i in live:
            starts[i] += len(feed[i])
        steps += 1
    assert counted == [True] * (3 * steps)  # every layer of every step ran fused (the loop runs count nothing)
    assert max(starts) > 6  # the windowed cases attended past their window
    assert whole[0] is False  # the prefills: gathered
    assert all(whole[1:]) if kernel_extend == 16 else not any(whole[1:])  # with 1: an extend in every step
    assert counted.stacks == (steps - 1 if kernel_extend == 16 else 0)


def test_a_step_with_a_prefill_runs_three_calls_a_layer(monkeypatch, counted):
    """A decode beside a 40-token prefill: the work before and after attention fused, the
    attention as the loop's (kernel for the decode, gathered for the prefill); the same bits."""
    r = _runner("qwen3", monkeypatch)
    t0, t1 = [], []
    blocks_of(r).ensure(t0, 8)
    r.forward([SeqInput([5, 6, 7, 8, 9, 10, 11], 0, t0)])
    blocks_of(r).ensure(t0, 9)
    blocks_of(r).ensure(t1, 40)
    counted.clear()
    fused, loop, kv_fused, kv_loop = _both_ways(r, [SeqInput([12], 7, t0), SeqInput(list(range(3, 43)), 0, t1)])
    assert counted == [True] * 3
    assert torch.equal(fused, loop) and torch.equal(kv_fused[0], kv_loop[0]) and torch.equal(kv_fused[1], kv_loop[1])


def test_a_layer_whose_projection_runs_another_path_runs_in_python(monkeypatch, counted):
    """Layer 1's down projection on oneDNN's packed weight at every row count: that layer runs
    the loop, the others are fused, and the step equals the loop's."""
    r = _runner("qwen2", monkeypatch)
    t = []
    blocks_of(r).ensure(t, 12)
    r.forward([SeqInput(list(range(5, 16)), 0, t)])
    down = r._native._plan[1][3]
    monkeypatch.setattr(down, "rule", PackRule.always(True, "test"))
    counted.clear()
    fused, loop, _, _ = _both_ways(r, [SeqInput([20], 11, t)])
    assert counted == [True, False, True]
    assert torch.equal(fused, loop)


def test_the_environment_turns_fused_layers_off(monkeypatch, counted):
    monkeypatch.setenv("TOKENROUTER_FUSED_LAYERS", "0")
    r = _runner("llama", monkeypatch)
    t = []
    blocks_of(r).ensure(t, 8)
    r.forward([SeqInput([5, 6, 7], 0, t)])
    r.forward([SeqInput([8], 3, t)])
    assert r._native._layer_calls is None and counted == []


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_between_layers_is_called_after_every_fused_layer(arch, monkeypatch, counted):
    """Core lending's callback runs between fused layers as between the loop's: a decode step,
    one call for the whole stack without it, runs one ``decoder_layer`` call a layer with it,
    and computes the same bits either way."""
    r = _runner(arch, monkeypatch)
    t = []
    blocks_of(r).ensure(t, 16)
    r.forward([SeqInput([5, 6, 7, 8, 9, 10, 11, 12], 0, t)])
    ops = torch.ops.tokenrouter_cpu
    n = {"layer": 0, "stack": 0}
    real_layer, real_stack = ops.decoder_layer, ops.decoder_stack
    monkeypatch.setattr(ops, "decoder_layer", lambda *a: n.__setitem__("layer", n["layer"] + 1) or real_layer(*a))
    monkeypatch.setattr(ops, "decoder_stack", lambda *a: n.__setitem__("stack", n["stack"] + 1) or real_stack(*a))
    counted.clear()
    free = _both_ways(r, [SeqInput([13], 8, t)])
    assert counted.stacks == 1 and n == {"layer": 0, "stack": 1}
    seen = []
    counted.clear()
    r.between_layers = lambda: seen.append(len(counted))
    lent = _both_ways(r, [SeqInput([13], 8, t)])
    assert counted == [True] * 3 and counted.stacks == 0 and seen == [1, 2, 3, 3, 3, 3]  # then the loop's 3
    assert n == {"layer": 3, "stack": 1}
    for a, b in zip(free, lent):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else all(map(torch.equal, a, b))
    assert torch.equal(free[0], free[1])


def test_a_wrapped_kernel_attend_is_called(monkeypatch, counted):
    """A spy on the kernel's ``attend`` sees every decode: such steps run the attention in Python
    between the two fused calls, and still equal the loop."""
    from tokenrouter_sdk.backends.attention import cpu_kernel as ck

    r = _runner("mistral", monkeypatch)
    seen = []
    real = ck.CpuKernel.attend
    monkeypatch.setattr(
        ck.CpuKernel, "attend", lambda self, kern, *a: seen.append(kern.q_len.tolist()) or real(self, kern, *a)
    )
    t = []
    blocks_of(r).ensure(t, 12)
    r.forward([SeqInput(list(range(5, 16)), 0, t)])
    counted.clear()
    seen.clear()
    fused, loop, _, _ = _both_ways(r, [SeqInput([20], 11, t)])
    assert counted == [True] * 3 and seen == [[1]] * 6  # 3 layers, fused then loop
    assert torch.equal(fused, loop)


def test_a_wrapped_kernel_store_runs_the_loop(monkeypatch, counted):
    """A spy on the kernel's ``store`` sees every layer's K/V: the fused calls, which store in
    C++, step aside for the loop."""
    from tokenrouter_sdk.backends.attention import cpu_kernel as ck

    r = _runner("llama", monkeypatch)
    stored = []
    real = ck.CpuKernel.store
    monkeypatch.setattr(
        ck.CpuKernel,
        "store",
        lambda self, kc, vc, slots, k, v: stored.append(len(slots)) or real(self, kc, vc, slots, k, v),
    )
    t = []
    blocks_of(r).ensure(t, 12)
    r.forward([SeqInput(list(range(5, 10)), 0, t)])  # no kernel part: fused, stored in C++
    assert counted == [True] * 3 and stored == []
    counted.clear()
    r.forward([SeqInput([20], 5, t)])
    assert counted == [] and stored == [1] * 3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_epsilon_changed_between_steps_is_used(arch, monkeypatch, counted):
    """A norm's ``variance_epsilon`` set between two steps is read by the fused calls as by the
    loop (each reads it at every call), in one-call and split steps."""
    r = _runner(arch, monkeypatch)
    t = []
    blocks_of(r).ensure(t, 16)
    r.forward([SeqInput(list(range(5, 12)), 0, t)])
    before = r.forward([SeqInput([20], 7, t)]).logits
    for m in r.model.modules():
        if hasattr(m, "variance_epsilon"):
            m.variance_epsilon += 0.3
    counted.clear()
    fused, loop, _, _ = _both_ways(r, [SeqInput([20], 7, t)])  # one call a layer
    assert counted == [True] * 3 and torch.equal(fused, loop) and not torch.allclose(fused, before)
    t2 = []
    blocks_of(r).ensure(t2, 12)
    counted.clear()
    fused, loop, _, _ = _both_ways(r, [SeqInput([21, 22, 23], 8, t), SeqInput(list(range(30, 40)), 0, t2)])
    assert counted == [True] * 3 and torch.equal(fused, loop)  # split: a prefill beside the extend


def test_the_kernel_gets_the_runner_s_tile_threshold_and_prefetch_in_either_path(monkeypatch, counted):
    """The tile threshold and the few-row kernel's prefetch the runner chose (here forced) reach
    the C++ in a one-call stack (``decoder_stack``'s last two arguments), in one-call layers
    (``decoder_layer``'s, core lending between them) and, when attention runs
    in Python between the layer's calls (a spy on the kernel's ``attend``), as the kernel op's last
    argument and the last of ``layer_qkv`` and ``layer_mlp``."""
    monkeypatch.setenv(kernel_choice.TILES_ENV, "7")
    monkeypatch.setenv(A.PREFETCH_ENV, "3")
    r = _runner("llama", monkeypatch)
    assert all(p.prefetch == A.Prefetch(3, 3) for p in r._native.projections)
    ops = torch.ops.tokenrouter_cpu
    got = {"stack": [], "layer": [], "op": [], "qkv": [], "mlp": []}
    real_stack, real_layer, real_qkv, real_mlp = ops.decoder_stack, ops.decoder_layer, ops.layer_qkv, ops.layer_mlp
    monkeypatch.setattr(ops, "decoder_stack", lambda *a: got["stack"].append(a[-2:]) or real_stack(*a))
    monkeypatch.setattr(ops, "decoder_layer", lambda *a: got["layer"].append(a[-2:]) or real_layer(*a))
    monkeypatch.setattr(ops, "layer_qkv", lambda *a: got["qkv"].append(a[-1]) or real_qkv(*a))
    monkeypatch.setattr(ops, "layer_mlp", lambda *a: got["mlp"].append(a[-1]) or real_mlp(*a))
    t = []
    blocks_of(r).ensure(t, 16)
    r.forward([SeqInput(list(range(5, 16)), 0, t)])
    r.forward([SeqInput([20], 11, t)])  # a decode alone: all layers in one call
    assert r.kernel_tiles == (7, f"forced ({kernel_choice.TILES_ENV}=7)")
    assert got["stack"] == [(7, 3)] and got["layer"] == []
    r.between_layers = lambda: None
    r.forward([SeqInput([21], 12, t)])  # core lending: one call a layer
    r.between_layers = None
    assert got["stack"] == [(7, 3)] and got["layer"] == [(7, 3)] * 3
    real_attend = cpu_kernel.CpuKernel.attend

    def attend(self, *a):  # the op this kernel calls, recorded for the call
        op = self.op
        self.op = lambda *args: got["op"].append(args[-1]) or op(*args)
        try:
            return real_attend(self, *a)
        finally:
            self.op = op

    monkeypatch.setattr(cpu_kernel.CpuKernel, "attend", attend)
    r.forward([SeqInput([22], 13, t)])
    assert got["op"] == [7] * 3 and got["layer"] == [(7, 3)] * 3  # 3 layers, attention in Python
    assert got["qkv"] == [3] * 6 and got["mlp"] == [3] * 6  # the prefill's layers (split) and these


def test_a_step_s_calls_take_the_prefetch_of_its_row_count(monkeypatch, counted):
    """Where the measured prefetch differs by step size (`autotune.Prefetch`), a step of one
    decode passes ``few`` and a step of three decodes ``many`` to the stack call, and to each
    layer's call with core lending between layers; the bits are the loop's either way."""
    r = _runner("llama", monkeypatch)
    for p in r._native.projections:
        p.prefetch = A.Prefetch(1, 3)
    ops, got = torch.ops.tokenrouter_cpu, {"stack": [], "layer": []}
    real_stack, real_layer = ops.decoder_stack, ops.decoder_layer
    monkeypatch.setattr(ops, "decoder_stack", lambda *a: got["stack"].append(a[-1]) or real_stack(*a))
    monkeypatch.setattr(ops, "decoder_layer", lambda *a: got["layer"].append(a[-1]) or real_layer(*a))
    ts = []
    for i in range(3):
        t = []
        blocks_of(r).ensure(t, 16)
        r.forward([SeqInput(list(range(5 + i, 12 + i)), 0, t)])
        ts.append(t)
    got["stack"].clear(), got["layer"].clear()
    fused, loop, _, _ = _both_ways(r, [SeqInput([20], 7, ts[0])])
    assert got["stack"] == [1] and torch.equal(fused, loop)
    fused, loop, _, _ = _both_ways(r, [SeqInput([21 + i], pos, t) for i, (t, pos) in enumerate(zip(ts, (8, 7, 7)))])
    assert got["stack"] == [1, 3] and torch.equal(fused, loop)
    r.between_layers = lambda: None  # core lending: one call a layer
    fused, loop, _, _ = _both_ways(r, [SeqInput([30], 9, ts[0])])
    assert torch.equal(fused, loop)
    fused, loop, _, _ = _both_ways(r, [SeqInput([31 + i], pos, t) for i, (t, pos) in enumerate(zip(ts, (10, 8, 8)))])
    assert got["layer"] == [1] * 3 + [3] * 3 and torch.equal(fused, loop) and got["stack"] == [1, 3]


def test_decoder_stack_names_what_does_not_fit(monkeypatch):
    """The stack op's lists must hold one entry (or one group) a layer; a mismatch raises an
    error that names the op and the list, before anything is written."""
    r = _runner("llama", monkeypatch, layers=2)
    t = []
    blocks_of(r).ensure(t, 8)
    r.forward([SeqInput([5, 6, 7], 0, t)])
    calls = r._native._layer_calls
    seen = {}
    real = torch.ops.tokenrouter_cpu.decoder_stack
    monkeypatch.setattr(torch.ops.tokenrouter_cpu, "decoder_stack", lambda *a: seen.setdefault("args", a) and None)
    r.forward([SeqInput([8], 3, t)])
    a = list(seen["args"])
    assert torch.equal(real(*a), real(*a))  # a valid call runs (it stores the same K/V twice)
    k = r.pool.k.clone()
    for i, bad, why in [
        (1, a[1][:-1], "6 tensors a layer"),
        (2, a[2][:-1], "4 biases a layer"),
        (15, a[15][:1], "scale, window and softcap one a layer"),
        (9, [0, 7], "layer 7 is not in the pools"),
    ]:
        b = list(a)
        b[i] = bad
        with pytest.raises(RuntimeError, match=why):
            real(*b)
    assert len(calls.layers) == 2 and torch.equal(r.pool.k, k)


def test_the_stack_sees_a_changed_rule_few_row_weight_or_norm_weight(monkeypatch, counted):
    """What the stack call keeps from step to step is made again when it changes: a projection
    put on another path runs its layer in Python; its few-row weight dropped, the same; a norm
    given a new weight and a prefetch measured again are read at the next step; each step
    equals the loop."""
    r = _runner("qwen3", monkeypatch)
    t = []
    blocks_of(r).ensure(t, 16)
    r.forward([SeqInput(list(range(5, 12)), 0, t)])
    pos = [7]

    def step():
        counted.clear()
        fused, loop, _, _ = _both_ways(r, [SeqInput([20 + pos[0]], pos[0], t)])
        pos[0] += 1
        assert torch.equal(fused, loop)
        return list(counted), counted.stacks, fused

    assert step()[:2] == ([True] * 3, 1)
    o = r._native._plan[2][1]
    rule = o.rule
    o.rule = PackRule.always(False, "test")
    assert step()[:2] == ([True, True, False], 0)
    o.rule = rule
    assert step()[:2] == ([True] * 3, 1)
    w = o.skinny
    o.skinny = None
    assert step()[:2] == ([True, True, False], 0)
    o.skinny = w
    assert step()[:2] == ([True] * 3, 1)
    norm = r.model.model.layers[1].post_attention_layernorm
    with torch.no_grad():
        norm.weight = torch.nn.Parameter(norm.weight * 3)
    assert step()[:2] == ([True] * 3, 1)  # equal to the loop, which reads the new weight
    pf = 3 if o.prefetch.few != 3 else 2  # a prefetch measured again: the next call gets it
    for p in r._native.projections:
        p.prefetch = A.Prefetch(pf, 0)
    ops, got = torch.ops.tokenrouter_cpu, []
    real = ops.decoder_stack
    monkeypatch.setattr(ops, "decoder_stack", lambda *a: got.append(a[-1]) or real(*a))
    assert step()[:2] == ([True] * 3, 1) and got == [pf]
