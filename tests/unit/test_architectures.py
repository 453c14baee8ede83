"""The architecture matrix: every architecture the runner accepts computes what the model
computes, on every path, or is refused at load time.

Each case is a tiny random-weight model built from its transformers config (windows of 8 keys,
soft-caps that bite) routed with its own first half, handing off every third token: every
generated token equals the argmax (or the seeded draw) of a full recomputation by its writer
(transformers' own forward over the whole prefix, ``use_cache=False``, on an untouched copy of
the models), and every log-probability equals that writer's log-softmax: exactly in float64
(1e-9), in float32 until the first near-tie of the reference. Prompts are shorter than, as long
as and longer than the window, and generation crosses it; the CPU kernel's split-K chunks are
forced small so that windows span chunk boundaries.

Gemma 2's only attention in transformers (eager) takes its softmax in float32 even on a float64
model, which would leave the float64 reference float32-accurate (log-probabilities off by about
1e-7): the reference's softmax stays in float64 there (`_float64_softmax`; an upcast to float32
of 16- and 32-bit scores is unchanged)."""

import copy

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.backends.attention import UnsupportedAttention, cpu_kernel, kernel_choice
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.models import tiny_model, truncate
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate

from ..helpers import KeepEveryThird

W = 8  # the sliding window of the windowed cases
PROMPT_LENS = (3, W, 13, 29)  # shorter than, as long as, longer than the window; past a kernel chunk
N_NEW = 20
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]

# name -> tiny_model arguments (4 layers; the routed small model is the first 2)
ARCHS = {
    "llama": dict(arch="llama"),
    "llama_rope": dict(arch="llama", rope_parameters=LLAMA3_ROPE),
    "mistral": dict(arch="mistral", sliding_window=W),
    "qwen2": dict(arch="qwen2", use_sliding_window=True, sliding_window=W, max_window_layers=1),
    "qwen3": dict(arch="qwen3"),
    "gemma": dict(arch="gemma", initializer_range=0.5),
    "gemma2": dict(
        arch="gemma2",
        sliding_window=W,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        query_pre_attn_scalar=24,
        initializer_range=0.5,
    ),
    # Gemma 3's attention passes no soft-cap even when the config has one: neither does ours
    "gemma3": dict(
        arch="gemma3",
        sliding_window=W,
        layer_types=GEMMA3_TYPES,
        query_pre_attn_scalar=24,
        final_logit_softcapping=5.0,
        attn_logit_softcapping=2.0,
        initializer_range=0.5,
    ),
}
# what each case's runner must have read from the model: per layer (window, soft-cap)
EXPECTED = {
    "llama": [(None, None)] * 4,
    "llama_rope": [(None, None)] * 4,
    "qwen3": [(None, None)] * 4,
    "gemma": [(None, None)] * 4,
    "mistral": [(W, None)] * 4,
    "qwen2": [(None, None)] + [(W, None)] * 3,
    "gemma2": [(W, 2.0), (None, 2.0)] * 2,
    "gemma3": [(W if t == "sliding_attention" else None, None) for t in GEMMA3_TYPES],
}


@pytest.fixture(autouse=True)
def _float64_softmax(monkeypatch):
    real = torch.nn.functional.softmax

    def softmax(x, dim=None, _stacklevel=3, dtype=None):
        return real(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)


def _pair(name, dtype):
    large = tiny_model(num_layers=4, seed=7, dtype=dtype, **ARCHS[name])
    return {"small": truncate(large, 2), "large": large}


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _near_tie(logits, tol=1e-4) -> bool:
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1]) < tol


def check_against_reference(models, ref_models, outs, policy_factory, params, dtype):
    """Tokens, writers and log-probabilities of ``outs`` equal the naive reference over
    ``ref_models`` (exact in float64; in float32 until the reference's first near-tie)."""
    for o in outs:
        ref = reference_generate(ref_models, list(o.prompt), policy_factory(), params, rid=o.rid, key=o.key)
        if dtype == torch.float64:
            assert o.token_ids == ref["token_ids"], (o.rid, o.token_ids, ref["token_ids"])
            assert o.token_models == ref["token_models"], o.rid
            assert o.logprobs == pytest.approx(ref["logprobs"], abs=1e-9), o.rid
            continue
        n = 0
        for i, lg in enumerate(ref["logits"][: len(ref["token_ids"])]):
            if _near_tie(lg) or i >= len(o.token_ids):
                break
            assert o.token_ids[i] == ref["token_ids"][i] and o.token_models[i] == ref["token_models"][i], (o.rid, i)
            assert abs(o.logprobs[i] - ref["logprobs"][i]) < 1e-4, (o.rid, i)
            n += 1
        assert n >= 4, f"request {o.rid}: a near-tie at token {n}: the float32 check compared too little"


def run_case(name, dtype, tok, *, sampled=False, chunk=None, monkeypatch=None, **router_kw):
    models = _pair(name, dtype)
    ref_models = copy.deepcopy(models)  # untouched by the Router: transformers' own forward
    if chunk is not None:  # small split-K chunks, and extends of up to 16 tokens in the kernel
        monkeypatch.setattr(cpu_kernel, "CHUNK", chunk)
        monkeypatch.setenv(kernel_choice.ENV, str(cpu_kernel.MAX_QUERIES))
    if sampled:
        params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, temperature=0.9, seed=11, logprobs=0)

        def policy():
            return RandomRouting(p=0.3, seed=5)
    else:
        params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, logprobs=0)
        policy = KeepEveryThird
    with Router(models, policy(), tokenizer=tok, max_kv_tokens=2048, **router_kw) as r:
        outs = r.generate(_prompts(), sampling=params, concurrency=4)
        spec = r.engine.runners["large"].spec if r.engine.runners else None
    if spec is not None:
        assert [(p.window, p.softcap) for p in spec.layers] == EXPECTED[name]
    assert {m for o in outs for m in o.token_models} == {"small", "large"}
    check_against_reference(models, ref_models, outs, policy, params, dtype)
    return outs


@pytest.mark.parametrize("kernels", ["wait", "off"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_float64_routed_greedy_equals_reference(name, kernels, monkeypatch, tok):
    """Kernels on (split-K chunks of 5 keys: windows and extends cross chunk boundaries) and off
    (the gather path)."""
    run_case(
        name,
        torch.float64,
        tok,
        chunk=5 if kernels == "wait" else None,
        monkeypatch=monkeypatch,
        kernels=kernels,
        processes=False,
    )


@pytest.mark.parametrize("name", list(ARCHS))
def test_float64_routed_sampled_equals_reference(name, tok):
    run_case(name, torch.float64, tok, sampled=True, processes=False)


@pytest.mark.parametrize("name", list(ARCHS))
def test_float32_routed_greedy_equals_reference(name, tok):
    run_case(name, torch.float32, tok, processes=False)


@pytest.mark.parametrize("name,processes", [("mistral", True), ("gemma2", True)])
def test_routed_in_processes_equals_reference(name, processes, tok):
    """Sub-servers in processes: the runner, its `AttentionSpec` and its model travel to the child."""
    run_case(name, torch.float32 if name == "mistral" else torch.float64, tok, processes=processes)


@pytest.mark.filterwarnings("ignore:cuda_graphs=True with a model that is not on a CUDA device")
@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma2", "gemma3"])
def test_fixed_shape_steps_honour_windows_and_softcaps(name, tok):
    """The CUDA-graph step path (run eagerly on the CPU: the same fixed shapes, padding and
    masks): one key mask per window, soft-capped scores, the final-logit soft-cap."""
    run_case(name, torch.float64, tok, processes=False, cuda_graphs=True)


def test_tensor_parallel_ranks_honour_windows_and_softcaps(tok):
    """Each tensor-parallel rank reads its shard's attention parameters as a single runner does."""
    run_case("gemma2", torch.float64, tok, processes=False, tp={"large": 2})


def _model(arch, **config):
    return tiny_model(arch=arch, num_layers=2, seed=3, **config)


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=8,
    )
    return GptOssForCausalLM(cfg).eval().double()


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=2,
        num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    return Qwen3NextForCausalLM(cfg).eval().double()


def _granite(**config):
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = GraniteConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **config,
    )
    return GraniteForCausalLM(cfg).eval().double()


def _llama_with(**fields):
    m = _model("llama")
    for k, v in fields.items():
        setattr(m.config, k, v)
    return m


REFUSED = {
    "attention sinks": (_gpt_oss, r"GptOssForCausalLM: layer 0 uses the attention keyword 's_aux'"),
    "linear attention": (_qwen3_next, r"Qwen3NextForCausalLM: layer 0 uses layer type 'linear_attention'"),
    "bidirectional": (
        lambda: _model("gemma3", use_bidirectional_attention=True, sliding_window=8),
        r"Gemma3ForCausalLM: every layer uses bidirectional attention",
    ),
    "logits scaling": (lambda: _granite(logits_scaling=4.0), r"GraniteForCausalLM: the LM head uses logit scaling"),
    "chunked attention": (
        lambda: _llama_with(attention_chunk_size=4),
        r"LlamaForCausalLM: the model uses chunked attention \(attention_chunk_size=4\)",
    ),
    "final soft-cap elsewhere": (
        lambda: _llama_with(model_type="unknown_arch", final_logit_softcapping=30.0),
        r"the LM head uses final-logit soft-capping .* on model type 'unknown_arch'",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_features_are_refused_at_load_time(case, tok):
    """A feature the runner does not compute is refused when the runner (or a Router) is built,
    naming the model, the layer and the feature and how to run it anyway;
    ``allow_unknown_attention=True`` builds it, with a warning that says what is ignored."""
    build, message = REFUSED[case]
    model = build()
    with pytest.raises(UnsupportedAttention, match=message) as e:
        TorchRunner(model, max_kv_tokens=64)
    assert "allow_unknown_attention=True" in str(e.value)
    with pytest.raises(UnsupportedAttention, match=message):
        Router({"m": model}, tokenizer=tok, processes=False)
    with pytest.warns(RuntimeWarning, match="allow_unknown_attention"):
        r = TorchRunner(model, max_kv_tokens=64, allow_unknown_attention=True)
    assert r.spec.ignored


def test_a_tensor_parallel_runner_refuses_before_its_ranks_start():
    from tokenrouter_sdk.backends.tensor_parallel import ModelRecipe, TensorParallelRunner

    with pytest.raises(UnsupportedAttention, match="s_aux"):
        TensorParallelRunner(ModelRecipe(_gpt_oss()), 2, max_kv_tokens=64)


def test_an_architecture_without_a_native_forward_takes_its_own_scales(tok):
    """Granite (no native forward, ``attention_multiplier`` as its attention scale, embedding and
    residual multipliers in its own modules) on the transformers path equals the reference."""
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = GraniteConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_multiplier=0.3,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        large = GraniteForCausalLM(cfg).eval().double().requires_grad_(False)
    models = {"small": truncate(large, 2), "large": large}
    ref = copy.deepcopy(models)
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, logprobs=0)
    with Router(models, KeepEveryThird(), tokenizer=tok, processes=False) as r:
        outs = r.generate(_prompts(), sampling=params)
        runner = r.engine.runners["large"]
        assert runner.impl == "transformers" and {p.scale for p in runner.spec.layers} == {0.3}
    check_against_reference(models, ref, outs, KeepEveryThird, params, torch.float64)


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3"])
def test_a_model_used_by_a_router_still_computes_its_own_forward(name, tok):
    """Outside a runner's steps a switched model runs its own attention with transformers' masks:
    ``model(...)`` after a Router equals an untouched copy's, windows and soft-caps included."""
    models = _pair(name, torch.float64)
    ref = copy.deepcopy(models)
    with Router(models, KeepEveryThird(), tokenizer=tok, processes=False) as r:
        r.generate([_prompts()[3]], max_new_tokens=4, ignore_eos=True)
    ids = torch.tensor([_prompts()[3] + _prompts()[2]])  # 42 tokens: past the window
    for m in ("small", "large"):
        with torch.no_grad():
            got, want = models[m](ids).logits, ref[m](ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
