"""Whole decoder layers in one C++ call (`tokenrouter_sdk.backends.fused_layers`): on every
architecture with a native forward (Llama, Mistral with its window, Qwen2 with q/k/v biases and
windows, Qwen3 with q/k norms), a float32 step of decodes and short extends computes the same
bits with the fused calls as with the Python layer loop (logits and the K/V written); steps the
call does not take (a prefill; a layer whose projection runs another GEMM path) run the loop,
and ``TOKENROUTER_FUSED_LAYERS=0`` turns it off."""

import random

import pytest
import torch

from tokenrouter_sdk.backends import cpu_kernels, fused_layers
from tokenrouter_sdk.backends.attention import cpu_kernel, kernel_choice
from tokenrouter_sdk.backends.autotune import PackRule
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.block_allocator import blocks_of
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.paged_attention_op(wait=True, timeout=600) is None,
                                reason="the C++ CPU kernels could not be built here")

ARCHS = {
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral", sliding_window=6),
    "qwen2": dict(arch="qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "qwen3": dict(arch="qwen3"),
}


@pytest.fixture
def counted(monkeypatch):
    """Per call of `LayerCalls.run`: whether it ran the layer (True) or left it to the loop."""
    calls: list[bool] = []
    real = fused_layers.LayerCalls.run

    def run(self, *a):
        y = real(self, *a)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(fused_layers.LayerCalls, "run", run)
    return calls


def _runner(arch, monkeypatch, layers=3):
    monkeypatch.setenv("TOKENROUTER_PACKING", "skinny")
    monkeypatch.setenv(kernel_choice.ENV, str(cpu_kernel.MAX_QUERIES))  # extends of up to 16 in the kernel
    model = tiny_model(num_layers=layers, seed=21, dtype=torch.float32, initializer_range=0.5, **ARCHS[arch])
    g = torch.Generator().manual_seed(3)
    for m in model.modules():  # transformers starts biases at zero: give Qwen2's q/k/v biases values
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    return TorchRunner(model, max_kv_tokens=1024, kernels="wait")


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


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_layers_equal_the_layer_loop_bit_for_bit(arch, monkeypatch, counted):
    """Decodes and extends of 2-9 tokens at contexts crossing the window, batches of 1-5:
    the same logits and the same K/V, every layer of every step fused."""
    r = _runner(arch, monkeypatch)
    rng = random.Random(5)
    b = 5
    tabs = [[] for _ in range(b)]
    starts = [0] * b
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 20))] for _ in range(b)]
    for t, p in zip(tabs, prompts):
        blocks_of(r).ensure(t, len(p))
    r.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tabs)])  # prefills: the loop
    starts = [len(p) for p in prompts]
    counted.clear()
    steps = 0
    for step in range(8):
        live = list(range(b)) if step % 3 else rng.sample(range(b), rng.randint(1, b))
        feed = {i: [rng.randrange(3, 250) for _ in range(rng.choice([1, 1, 2, 9]))] for i in live}
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


def test_a_step_the_kernel_does_not_attend_whole_runs_the_loop(monkeypatch, counted):
    """A step with a prefill (attended over a gathered copy) never calls the fused layers."""
    r = _runner("llama", monkeypatch)
    t0, t1 = [], []
    blocks_of(r).ensure(t0, 8)
    r.forward([SeqInput([5, 6, 7, 8, 9, 10, 11], 0, t0)])
    blocks_of(r).ensure(t0, 9)
    blocks_of(r).ensure(t1, 40)
    counted.clear()
    r.forward([SeqInput([12], 7, t0), SeqInput(list(range(3, 43)), 0, t1)])
    assert counted == []


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


def test_between_layers_is_called_after_every_fused_layer(monkeypatch, counted):
    """Core lending's callback runs between fused layers as between the loop's."""
    r = _runner("llama", monkeypatch)
    t = []
    blocks_of(r).ensure(t, 8)
    r.forward([SeqInput([5, 6, 7], 0, t)])
    seen = []
    r.between_layers = lambda: seen.append(len(counted))
    r.forward([SeqInput([8], 3, t)])
    assert counted == [True] * 3 and seen == [1, 2, 3]
