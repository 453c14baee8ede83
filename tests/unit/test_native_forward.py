"""The native forward (`tokenrouter_sdk.backends.native_forward`, ``model_impl="auto"``): on
float64 models its logits, hidden states and K/V equal the transformers forward's bit for bit
(Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms; prefill, decode, extend, mixed batches);
float32 steps with prepacked projections (4+ rows) stay within float32 rounding of it, bfloat16
within the stated bf16 tolerance; weights changed after a step are read again; a linear with
hooks (tensor parallelism's all-reduce) runs as its module; models without a native forward
take transformers' (``"auto"``) or raise (``"native"``); routed generation equals the naive
reference."""

import pickle
import random

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.backends import projection as P
from tokenrouter_sdk.backends.native_forward import native_support
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.config import EngineConfig
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import tiny_model, truncate
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate

from ..helpers import mixed_prompts


def _table(runner, n):
    t: list[int] = []
    blocks_of(runner).ensure(t, n)
    return t


def _runners(model, **kw):
    return TorchRunner(model, max_kv_tokens=2048, **kw), TorchRunner(
        model, max_kv_tokens=2048, model_impl="transformers"
    )


def _steps(rng, b, n_steps=4):
    """Per step, per request, the tokens fed: a prompt, then decodes, extends and a mix."""
    feeds = [[[rng.randrange(3, 250) for _ in range(rng.randint(2, 30))] for _ in range(b)]]
    for _ in range(n_steps - 1):
        feeds.append([[rng.randrange(3, 250) for _ in range(rng.choice([1, 1, 1, 4, 9]))] for _ in range(b)])
    return feeds


def _run_pair(native, plain, feeds, *, all_hidden=False, check=None):
    """Feed both runners the same steps; ``check(out_native, out_plain)`` after each; finally
    compare the K/V of every request."""
    b = len(feeds[0])
    tabs = {id(r): [[] for _ in range(b)] for r in (native, plain)}
    starts = [0] * b
    for feed in feeds:
        outs = {}
        for r in (native, plain):
            for t, s, f in zip(tabs[id(r)], starts, feed):
                blocks_of(r).ensure(t, s + len(f))
            outs[id(r)] = r.forward(
                [SeqInput(f, s, t, all_hidden=all_hidden) for f, s, t in zip(feed, starts, tabs[id(r)])]
            )
        check(outs[id(native)], outs[id(plain)])
        starts = [s + len(f) for s, f in zip(starts, feed)]
    kv = []
    for n, a, c in zip(starts, tabs[id(native)], tabs[id(plain)]):
        kv.append(
            (
                native.pool.k[:, native.pool.slots(a, 0, n)],
                plain.pool.k[:, plain.pool.slots(c, 0, n)],
                native.pool.v[:, native.pool.slots(a, 0, n)],
                plain.pool.v[:, plain.pool.slots(c, 0, n)],
            )
        )
    return kv


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_native_equals_transformers_bit_for_bit_on_float64(arch):
    model = tiny_model(arch=arch, num_layers=3, seed=5)
    native, plain = _runners(model)
    assert native.impl == "native" and plain.impl == "transformers"
    rng = random.Random(arch)
    ran = 0

    def same(a, b):
        nonlocal ran
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
        assert len(a.fed_hidden) == len(b.fed_hidden)
        for x, y in zip(a.fed_hidden, b.fed_hidden):
            assert torch.equal(x, y)
        ran += 1

    for b in (1, 2, 5):
        for k1, k2, v1, v2 in _run_pair(native, plain, _steps(rng, b), all_hidden=True, check=same):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert ran == 12
    assert native._native is not None and plain._native is None


def test_qwen2_biases_are_read():
    """Qwen2's q/k/v biases enter the merged projection: zeroing them changes the logits."""
    model = tiny_model(arch="qwen2", num_layers=2, seed=6)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    native, plain = _runners(model)
    feeds = [[[5, 6, 7, 8]], [[9]]]
    _run_pair(native, plain, feeds, check=lambda a, b: torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0))


def _float32_pair(b, seed):
    """A float32 model, its native runner and its transformers runner; the native one runs ATen
    ops between its GEMMs (the fused C++ step ops change float32 rounding: `test_cpu_kernel`)."""
    model = tiny_model(num_layers=3, seed=seed, dtype=torch.float32)
    return model, *_runners(model, kernels="off")


@pytest.mark.skipif(not P.packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")
def test_float32_packed_projections_within_rounding(monkeypatch):
    """Forced packed, a float32 step takes the prepacked merged projections: logits, hidden
    states and K/V within float32 rounding (1e-5 absolute on logits of spread ~1) of transformers."""
    monkeypatch.setenv("TOKENROUTER_PACKING", "packed")
    model, native, plain = _float32_pair(6, seed=7)
    rng = random.Random(7)
    seen = []

    def close(a, b):
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=0, atol=1e-5)
        seen.append(a.logits.shape[0])

    for k1, k2, v1, v2 in _run_pair(native, plain, _steps(rng, 6), check=close):
        torch.testing.assert_close(k1, k2, rtol=0, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=0, atol=1e-5)
    qkv = native._native._plan[0][0]
    assert qkv.packed is not None and qkv.rule(6) and qkv.rule(1) and qkv.rule.source.startswith("forced")
    assert native._native._head.packed is not None


@pytest.mark.skipif(not P.packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")
def test_a_wrong_packed_projection_is_caught(monkeypatch):
    """The float32 comparison above can fail: a packed weight that differs from the model's
    (here: packed from doubled weights) moves the logits far outside the tolerance."""
    monkeypatch.setenv("TOKENROUTER_PACKING", "packed")
    model, native, plain = _float32_pair(6, seed=8)
    native.forward([SeqInput([5] * 6, 0, _table(native, 16))])
    qkv = native._native._plan[0][0]
    qkv.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([m.weight.detach() * 2 for m in qkv.mods]), 8)
    tabs = [_table(native, 16) for _ in range(6)], [_table(plain, 16) for _ in range(6)]
    outs = [r.forward([SeqInput([7 + i, 8], 0, t) for i, t in enumerate(tb)]) for r, tb in zip((native, plain), tabs)]
    assert (outs[0].logits - outs[1].logits).abs().max().item() > 1e-3


def test_bfloat16_native_within_the_stated_tolerance():
    """bf16 weights and KV: native (packed on oneDNN's bf16 kernels) and transformers bf16 steps
    both stay within 0.1 of the float32 step's logit spread (the tolerance bf16 is stated with:
    argmax agreement is not promised at bf16)."""
    m32 = tiny_model(num_layers=2, seed=31, dtype=torch.float32)
    m16 = tiny_model(num_layers=2, seed=31, dtype=torch.bfloat16)
    r32 = TorchRunner(m32, max_kv_tokens=256, model_impl="transformers")
    n16, t16 = _runners(m16)
    feeds = [[[3, 4, 5, 6, 7], [8, 9], [1, 2, 3], [4, 5, 6, 7]], [[10], [11], [12], [13]], [[12, 13], [14], [1], [2]]]
    tabs = {id(r): [[] for _ in range(4)] for r in (r32, n16, t16)}
    starts = [0] * 4
    for feed in feeds:
        out = {}
        for r in (r32, n16, t16):
            for t, s, f in zip(tabs[id(r)], starts, feed):
                blocks_of(r).ensure(t, s + len(f))
            out[id(r)] = r.forward([SeqInput(f, s, t) for f, s, t in zip(feed, starts, tabs[id(r)])]).logits.float()
        spread = out[id(r32)].std().item()
        assert (out[id(n16)] - out[id(r32)]).abs().max().item() <= 0.1 * spread
        assert (out[id(t16)] - out[id(r32)]).abs().max().item() <= 0.1 * spread
        starts = [s + len(f) for s, f in zip(starts, feed)]
    assert n16.impl == "native" and n16.dtype == torch.bfloat16


@pytest.mark.parametrize("change", ["in_place", "replaced", "dtype"])
def test_weights_changed_after_a_step_are_read_again(change):
    """Packed and merged weights are rebuilt when a weight changes in place (training), is
    replaced (``module.weight = ...``) or converted (``model.to(dtype)``)."""
    model = tiny_model(num_layers=2, seed=9, dtype=torch.float32)
    native = TorchRunner(model, max_kv_tokens=512)
    feed = [[5 + i, 6, 7] for i in range(6)]
    native.forward([SeqInput(f, 0, _table(native, 16)) for f in feed])
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        if change == "in_place":
            attn.k_proj.weight.mul_(1.5)
        elif change == "replaced":
            attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight * 0.5, requires_grad=False)
        else:
            model.to(torch.float64)
    # a new runner finds the projections this process built (now stale) in the modules; the
    # first runner's pool was sized for float32, so after model.to(float64) only new runners apply
    fresh_native = TorchRunner(model, max_kv_tokens=512)
    plain = TorchRunner(model, max_kv_tokens=512, model_impl="transformers")
    runners = (fresh_native, plain) if change == "dtype" else (native, fresh_native, plain)
    got = [r.forward([SeqInput(f, 0, _table(r, 16)) for f in feed]).logits for r in runners]
    for g in got[:-1]:
        torch.testing.assert_close(g, got[-1], rtol=0, atol=1e-5)


def test_a_linear_with_hooks_runs_as_its_module():
    """A forward hook on a linear (what tensor parallelism puts on its row-wise layers) runs in
    the native forward: its effect shows in the logits as in the transformers forward; removed,
    the projection goes back to the merged GEMM."""
    model = tiny_model(num_layers=2, seed=10)
    native, plain = _runners(model)
    native.forward([SeqInput([5, 6, 7], 0, _table(native, 16))])
    assert native._native._plan[0][1].plain  # built before the hook: rebuilt when it appears
    h = model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda mod, args, out: out * 3)
    try:
        _run_pair(
            native,
            plain,
            [[[5, 6, 7]], [[8]]],
            check=lambda a, b: torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0),
        )
        assert native.last_impl == "native" and not native._native._plan[0][1].plain
    finally:
        h.remove()
    native.forward([SeqInput([5, 6, 7], 0, _table(native, 16))])
    assert native.last_impl == "native" and native._native._plan[0][1].plain


@pytest.mark.parametrize("where", ["layer", "mlp", "norm", "global"])
def test_hooks_the_native_forward_would_bypass_make_steps_run_transformers(where):
    """Activation hooks on modules whose forward the native path does not call (a layer, an MLP,
    a norm) or a global module hook: those steps run the transformers forward, so the hook sees
    and changes what it would without the SDK; once removed, steps are native again."""
    model = tiny_model(num_layers=2, seed=14)
    native, plain = _runners(model)
    seen = []

    def hook(mod, args, out):
        seen.append(mod)
        return out * 1.5 if isinstance(out, torch.Tensor) else out

    target = {
        "layer": model.model.layers[1],
        "mlp": model.model.layers[0].mlp,
        "norm": model.model.layers[1].input_layernorm,
    }.get(where)
    h = (
        target.register_forward_hook(hook)
        if target is not None
        else torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(mod))
    )
    try:
        _run_pair(
            native,
            plain,
            [[[5, 6, 7], [9, 9]], [[8], [7]]],
            check=lambda a, b: torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0),
        )
        assert native.last_impl == "transformers" and seen
    finally:
        h.remove()
    native.forward([SeqInput([5, 6, 7], 0, _table(native, 16))])
    assert native.last_impl == "native"


@pytest.mark.parametrize(
    "where,first_step",
    [
        ("mlp", True),
        ("attention", True),
        ("norm", True),
        ("layer", True),
        ("linear", True),
        ("class", True),
        ("class", False),
        ("class forward", True),
        ("subclass instance", True),
    ],
)
def test_a_forward_patched_on_a_module_is_honoured(where, first_step):
    """A forward set on a module instance (an ablation or steering patch: ``mlp.forward = ...``),
    a module's class swapped for a subclass with another forward (after a native step, or before
    the runner's first), the class's own ``forward`` patched, or a module replaced by an instance
    of such a subclass changes the model as the transformers forward sees it, and the native
    forward's steps equal those; once undone, the steps are native and unchanged again. (A step
    that ignored the patch would give the unpatched logits with no error.)"""
    model = tiny_model(num_layers=2, seed=16)
    feed = [[[5, 6, 7], [9, 9]], [[8], [7]]]
    before = []
    ref_native, ref_plain = _runners(model)
    _run_pair(ref_native, ref_plain, feed, check=lambda a, b: before.append(a.logits.clone()))
    native, plain = _runners(model)
    if first_step:
        _run_pair(native, plain, feed, check=lambda a, b: None)
    layer = model.model.layers[0]
    target = {
        "mlp": layer.mlp,
        "attention": layer.self_attn,
        "norm": layer.post_attention_layernorm,
        "layer": model.model.layers[1],
        "linear": layer.mlp.down_proj,
    }.get(where, layer.mlp)
    real, cls = target.forward, type(target)
    halved = type("Halved", (cls,), {"forward": lambda self, x: cls.forward(self, x) * 0.5})
    if where == "class":
        target.__class__ = halved
    elif where == "class forward":
        cls.forward = lambda self, x, _f=cls.forward: _f(self, x) * 0.5
    elif where == "subclass instance":
        sub = halved(model.config).to(next(target.parameters()).dtype)
        sub.load_state_dict(target.state_dict())
        layer.mlp = sub
    elif where == "attention":
        target.forward = lambda *a, **k: tuple(o * 0.5 if torch.is_tensor(o) else o for o in real(*a, **k))
    elif where == "layer":
        target.forward = lambda *a, **k: real(*a, **k) + 0.5  # (a scale would vanish in the final norm)
    else:
        target.forward = lambda x: real(x) * 0.5
    after = []
    try:
        _run_pair(
            native,
            plain,
            feed,
            check=lambda a, b: (torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0), after.append(a.logits)),
        )
    finally:
        if where == "class":
            target.__class__ = cls
        elif where == "class forward":
            cls.forward = cls.forward.__defaults__[0]
        elif where == "subclass instance":
            layer.mlp = target
        else:
            del target.forward
    assert not torch.equal(after[0], before[0])  # the patch changed the model
    again = []
    _run_pair(native, plain, feed, check=lambda a, b: again.append(a.logits))
    assert native.last_impl == "native" and all(torch.equal(x, y) for x, y in zip(again, before))


def test_a_replaced_module_is_read():
    """A projection module replaced after a step (a wrapper, as adapters do) is what the next
    native step runs."""
    model = tiny_model(num_layers=2, seed=15)
    native, plain = _runners(model)
    native.forward([SeqInput([5, 6, 7], 0, _table(native, 16))])

    class Doubled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return 2 * self.inner(x)

    mlp = model.model.layers[0].mlp
    mlp.up_proj = Doubled(mlp.up_proj)
    _run_pair(
        native,
        plain,
        [[[5, 6, 7]], [[8]]],
        check=lambda a, b: torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0),
    )
    assert native.last_impl == "native" and not native._native._plan[0][2].plain


def test_model_impl_choice_and_errors():
    model = tiny_model(num_layers=2, seed=11)
    with pytest.raises(ValueError, match="model_impl must be one of"):
        TorchRunner(model, max_kv_tokens=64, model_impl="fast")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        EngineConfig(model_impl="vllm")
    assert TorchRunner(model, max_kv_tokens=64, model_impl="native").impl == "native"
    assert TorchRunner(model, max_kv_tokens=64, model_impl="transformers").impl == "transformers"
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).eval()
    assert "gpt2" in native_support(gpt2)
    m2 = tiny_model(num_layers=2, seed=11)
    m2.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert "GELU" in native_support(m2)
    r = TorchRunner(m2, max_kv_tokens=64)
    assert r.impl == "transformers" and "GELU" in r.native_reason
    with pytest.raises(ValueError, match="no native forward .*GELU"):
        TorchRunner(m2, max_kv_tokens=64, model_impl="native")


def test_truncated_model_shares_the_large_models_projections(pair):
    """A truncation (or self-draft) shares its first layers with the large model: in one process
    their projections (and packed weights) are built once."""
    large, small = pair["large"], pair["small"]
    rl, rs = TorchRunner(large, max_kv_tokens=128), TorchRunner(small, max_kv_tokens=128)
    for r in (rl, rs):
        r.forward([SeqInput([5, 6], 0, _table(r, 16))])
    assert rs._native._plan[0][0] is rl._native._plan[0][0]
    assert rs._native._plan[1][2] is rl._native._plan[1][2]


def test_runner_pickles_without_packed_weights():
    """A runner that ran native steps travels to a sub-server process without its projections
    (packed weights belong to the process that made them) and rebuilds them there."""
    model = tiny_model(num_layers=2, seed=12, dtype=torch.float32)
    r = TorchRunner(model, max_kv_tokens=256)
    feed = [[5 + i, 6] for i in range(5)]
    before = r.forward([SeqInput(f, 0, _table(r, 16)) for f in feed]).logits
    r2 = pickle.loads(pickle.dumps(r))
    assert r2._native is None and r2.impl == "native"
    after = r2.forward([SeqInput(f, 0, _table(r2, 16)) for f in feed]).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_router_passes_model_impl(pair, tok):
    with Router(pair, RandomRouting(p=0.3), tokenizer=tok, max_kv_tokens=512, model_impl="transformers") as r:
        assert {x.impl for x in r.engine.runners.values()} == {"transformers"}
    with Router(pair, RandomRouting(p=0.3), tokenizer=tok, max_kv_tokens=512) as r:
        assert {x.impl for x in r.engine.runners.values()} == {"native"}


def routed_float32_run_equals_reference(tok, mode, check_router=None, **router_kw):
    """A float32 pair (truncation) at 6 requests in flight, handoffs both ways: routed greedy
    output equals the naive reference (transformers, one request at a time, no cache), with at
    least 4 hops. ``check_router(router)`` runs before the Router closes."""
    large = tiny_model(num_layers=4, seed=13, dtype=torch.float32, initializer_range=0.5)
    models = {"small": truncate(large, 2), "large": large}
    policy = RandomRouting(p=0.3, seed=4)
    prompts = mixed_prompts(6, seed=13)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    with Router(models, policy, tokenizer=tok, max_kv_tokens=2048, mode=mode, **router_kw) as r:
        outs = r.generate(prompts, sampling=params, concurrency=6)
        if check_router is not None:
            check_router(r)
    hops = 0
    for o in outs:
        ref = reference_generate(models, o.prompt, policy, params, rid=o.rid)
        assert o.token_ids == ref["token_ids"] and o.token_models == ref["token_models"]
        hops += o.hops
    assert hops >= 4


@pytest.mark.parametrize("choice", ["packed", "plain", "auto"])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_routed_float32_generation_equals_reference_whichever_gemm_path_runs(tok, mode, choice, monkeypatch):
    """Decode steps of 6 requests run the packed projections, the plain ones or what this
    machine measured; routed output equals the naive reference in each case."""
    monkeypatch.setenv("TOKENROUTER_PACKING", choice)

    def check(r):
        qkv = r.engine.runners["large"]._native._plan[0][0]
        if P.packing_available(torch.device("cpu"), torch.float32):
            assert qkv.packed is not None
            if choice != "auto":
                assert qkv.rule(6) == (choice == "packed") and qkv.rule.source.startswith("forced")
            else:
                assert qkv.rule.source in ("measured", "cached")

    routed_float32_run_equals_reference(tok, mode, check)


def test_between_layers_is_called_after_every_layer_and_never_travels():
    model = tiny_model(num_layers=3, seed=16)
    r = TorchRunner(model, max_kv_tokens=256)
    calls = []
    r.between_layers = lambda: calls.append(1)
    r.forward([SeqInput([5, 6, 7], 0, _table(r, 16))])
    assert len(calls) == 3
    assert pickle.loads(pickle.dumps(r)).between_layers is None
