"""`DecodeGraphs`: the fixed-shape decode path that CUDA graphs replay. On the CPU it runs eagerly
(no capture), which checks the bucketing, padding, scratch slot and masking against the eager
forward and the naive reference; only the capture itself needs a GPU."""

import pickle
import random

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.backends.cuda_graphs import DecodeGraphs
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import tiny_model
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate

from ..helpers import DiscardTwoBack, mixed_prompts


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model(arch="qwen3", num_layers=2, seed=4)


def _prefill(runner, prompts, extra=40):
    tables = [[] for _ in prompts]
    for t, p in zip(tables, prompts):
        blocks_of(runner).ensure(t, len(p) + extra)
    runner.forward([SeqInput(p, 0, t) for t, p in zip(tables, prompts)])
    return tables


def test_buckets(qwen3):
    g = TorchRunner(qwen3, max_kv_tokens=4096, cuda_graphs=True).graphs
    assert [g.pow2(n) for n in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    dec = [SeqInput([3], 200, [0]) for _ in range(3)]
    assert g.bucket(dec) == (4, 1, 256)
    assert g.bucket(dec + [SeqInput([3, 4, 5], 10, [0])]) == (4, 4, 256)  # a short extend
    assert g.bucket([SeqInput([3], 1, [0])]) == (1, 1, 128)  # min_context
    assert g.bucket([SeqInput([1] * 33, 0, [0])]) is None  # a prefill longer than max_query
    assert g.bucket([SeqInput([3], 10, [0])] * 65) is None  # above max_batch
    assert g.bucket([SeqInput([3] * 32, 10, [0])] * 64) is None  # 64 x 32 > max_tokens
    assert g.bucket([SeqInput([3], 5000, [0])] * 32) is None  # 32 x 8192 > max_kv_tokens
    assert g.bucket([]) is None


def test_scratch_slot_is_never_handed_out(qwen3):
    r = TorchRunner(qwen3, max_kv_tokens=64, block_size=16, cuda_graphs=True)
    assert (r.pool.num_blocks, r.pool.capacity_tokens, r.pool.scratch_slot) == (4, 64, 64)
    assert r.pool.k.shape[1] == 80  # 4 usable blocks + 1 scratch block
    table: list[int] = []
    blocks_of(r).ensure(table, 64)
    assert sorted(table) == [0, 1, 2, 3] and blocks_of(r).num_free == 0
    assert TorchRunner(qwen3, max_kv_tokens=64).pool.scratch_slot is None
    one = TorchRunner(qwen3, max_kv_tokens=4, block_size=1, cuda_graphs=True)  # 2 one-slot scratch blocks
    assert (one.pool.scratch_slot, one.pool.k.shape[1], one.graphs.read_slot) == (4, 6, 5)


def test_nan_in_the_padding_slot_never_reaches_a_request(qwen3):
    """Padding rows write the scratch block's first slot; masked-out and padding keys read its
    second, never-written slot. Even a NaN in the written one stays out of real requests."""
    eager = TorchRunner(qwen3, max_kv_tokens=2048)
    fixed = TorchRunner(qwen3, max_kv_tokens=2048, cuda_graphs=True)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7]]
    te, tf = _prefill(eager, prompts), _prefill(fixed, prompts)
    for step in range(3):
        w = fixed.pool.scratch_slot
        fixed.pool.k[:, w] = float("nan")
        fixed.pool.v[:, w] = float("nan")
        feed = [SeqInput([7], len(p) + step, t) for p, t in zip(prompts, te)]
        le, _, _ = eager.forward(feed)
        lf, _, _ = fixed.forward([SeqInput([7], len(p) + step, t) for p, t in zip(prompts, tf)])  # B=3 -> bucket 4
        assert torch.isfinite(lf).all()
        torch.testing.assert_close(lf, le, rtol=0, atol=1e-10)
    r = fixed.graphs.read_slot
    assert (fixed.pool.k[:, r] == 0).all() and (fixed.pool.v[:, r] == 0).all()


def test_fixed_shape_steps_equal_eager_forward(qwen3):
    """Batches of 1..11 requests feeding 1 to 20 tokens (decodes, extends as after a handoff,
    short prefills), contexts across the 128/256/512 buckets: the same logits and hidden states as
    the eager forward and the same K/V in every request slot; padding writes only the scratch slot."""
    eager = TorchRunner(qwen3, max_kv_tokens=16384)
    fixed = TorchRunner(qwen3, max_kv_tokens=16384, cuda_graphs=True)
    idle: list[int] = []  # a request that is not stepped owns block 0 (what a padding row must not touch)
    blocks_of(fixed).ensure(idle, 20)
    idle_slots = fixed.pool.slots(idle, 0, 20)
    fixed.pool.k[:, idle_slots] = 7.0
    fixed.pool.v[:, idle_slots] = -7.0
    rng = random.Random(0)
    steps = 0
    for b in (1, 3, 8, 11):
        prompts = [[rng.randrange(1, 250) for _ in range(rng.randint(2, 400))] for _ in range(b)]
        te, tf = _prefill(eager, prompts, extra=80), _prefill(fixed, prompts, extra=80)
        lens = [len(p) for p in prompts]
        for _ in range(4):
            feed = [[rng.randrange(1, 250) for _ in range(rng.choice([1, 1, 2, 7, 20]))] for _ in range(b)]
            le, he, _ = eager.forward([SeqInput(f, n, t) for f, n, t in zip(feed, lens, te)])
            lf, hf, _ = fixed.forward([SeqInput(f, n, t) for f, n, t in zip(feed, lens, tf)])
            assert lf.shape == le.shape == (b, eager.vocab_size) and hf.shape == he.shape
            torch.testing.assert_close(lf, le, rtol=0, atol=1e-10)
            torch.testing.assert_close(hf, he, rtol=0, atol=1e-10)
            lens = [n + len(f) for n, f in zip(lens, feed)]
            steps += 1
        for n, t_e, t_f in zip(lens, te, tf):
            se, sf = eager.pool.slots(t_e, 0, n), fixed.pool.slots(t_f, 0, n)
            torch.testing.assert_close(fixed.pool.k[:, sf], eager.pool.k[:, se], rtol=0, atol=1e-10)
            torch.testing.assert_close(fixed.pool.v[:, sf], eager.pool.v[:, se], rtol=0, atol=1e-10)
        for t in te:
            blocks_of(eager).free(t)
        for t in tf:
            blocks_of(fixed).free(t)
    g = fixed.graphs
    assert g.replays == steps == 16 and g.captured == 0 and g.error is None
    assert {q for _, q, _ in g._buckets} >= {1, 32}
    assert fixed.pool.k[:, fixed.pool.scratch_slot].abs().sum() > 0  # padding wrote there
    assert idle[0] == 0 and (fixed.pool.k[:, idle_slots] == 7.0).all() and (fixed.pool.v[:, idle_slots] == -7.0).all()
    # a prefill longer than max_query runs eagerly
    before = g.replays
    _prefill(fixed, [list(range(1, 60))])
    assert g.replays == before


def test_capture_failure_falls_back_to_eager(qwen3, monkeypatch):
    r = TorchRunner(qwen3, max_kv_tokens=2048, cuda_graphs=True)
    ref = TorchRunner(qwen3, max_kv_tokens=2048)
    g = r.graphs
    g.capture = True  # as on a GPU; the capture raises, as an unsupported op would

    def boom(bk):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(g, "_capture", boom)
    prompt = [4, 9, 2, 7, 11]
    with pytest.warns(RuntimeWarning, match="stream is capturing"):
        t = _prefill(r, [prompt])[0]  # a 5-token prefill fits a bucket: the first capture
    tr = _prefill(ref, [prompt])[0]
    lg, _, _ = r.forward([SeqInput([3], 5, t)])
    le, _, _ = ref.forward([SeqInput([3], 5, tr)])
    torch.testing.assert_close(lg, le, rtol=0, atol=1e-10)
    assert "stream is capturing" in g.error and g.disabled and g.replays == 0
    r.forward([SeqInput([5], 6, t)])  # later steps: no second warning, still eager
    assert g.replays == 0


def test_errors(qwen3):
    with pytest.raises(ValueError, match="scratch block of at least 2 slots"):
        DecodeGraphs(TorchRunner(qwen3, max_kv_tokens=256), capture=False)
    with pytest.raises(ValueError, match="needs a CUDA model"):
        DecodeGraphs(TorchRunner(qwen3, max_kv_tokens=256, cuda_graphs=True), capture=True)


def test_runner_pickles_without_its_graphs(qwen3):
    r = TorchRunner(qwen3, max_kv_tokens=256, cuda_graphs=True)
    t = _prefill(r, [[1, 2, 3]])[0]
    r.forward([SeqInput([4], 3, t)])
    assert r.graphs.replays == 2  # the 3-token prefill and the decode
    clone = pickle.loads(pickle.dumps(r))
    assert clone._graphs is None and clone.cuda_graphs and clone.graphs.replays == 0


@pytest.mark.filterwarnings("ignore:cuda_graphs=True with a model that is not on a CUDA device")
@pytest.mark.parametrize("mode,processes", [("async", False), ("delayed", False), ("sync", False), ("async", True)])
def test_routed_generation_with_graphs_equals_reference(pair, tok, mode, processes):
    """Invariant 5 with the fixed-shape decode path: exactly the naive reference's tokens."""
    policy = DiscardTwoBack() if mode == "async" else RandomRouting(p=0.3, seed=3)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = mixed_prompts(8, seed=7)
    th = {"small": 2, "large": 1} if mode == "delayed" else None
    with Router(pair, policy, tokenizer=tok, mode=mode, thresholds=th, cuda_graphs=True, processes=processes) as r:
        outs = r.generate(prompts, sampling=params, concurrency=8)
        if not processes:
            assert all(run.graphs.replays > 0 for run in r.engine.runners.values())
    hops = 0
    for o in outs:
        assert o.finish_reason == "length", o.error  # graphs on the CPU: the fixed-shape path, uncaptured
        ref = reference_generate(pair, o.prompt, policy, params, rid=o.rid)
        assert o.token_ids == ref["token_ids"] and o.token_models == ref["token_models"]
        hops += o.hops
    assert hops >= 4


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("mask_dims", [0, 2, 4])
@pytest.mark.parametrize("nq", [1, 5])
def test_grouped_query_attention_equals_repeated_kv(mask_dims, nq, softcap):
    """`attend_masked` folds the query heads of a KV head into the query dimension: the same
    result as repeating K/V per query head (transformers' repeat_kv) with the mask applied per
    query; with a soft-cap (the explicit-scores path) the same as the capped scores' softmax."""
    from tokenrouter_sdk.backends.attention import LayerParams
    from tokenrouter_sdk.backends.attention.gather import attend_masked

    g = torch.Generator().manual_seed(0)
    b, hkv, grp, L, d = 3, 2, 3, 11, 8
    q = torch.randn(b, hkv * grp, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, L, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, L, d, generator=g, dtype=torch.float64)
    full = torch.rand(b, 1, nq, L, generator=g) < 0.7
    full[..., 0] = True
    mask = {0: None, 2: full[0, 0], 4: full}[mask_dims]
    kr, vr = k.repeat_interleave(grp, dim=1), v.repeat_interleave(grp, dim=1)
    s = q @ kr.transpose(-1, -2) * d**-0.5
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    want = s.softmax(-1) @ vr
    got = attend_masked(q, k, v, mask, LayerParams(None, softcap, d**-0.5))
    assert got.shape == (b, hkv * grp, nq, d)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (CI has none; evals/throughput/gpu_pair.py runs the same checks on a GPU lease)",
)


@needs_cuda
def test_cuda_capture_and_replay_equal_eager():
    m = tiny_model(arch="qwen3", num_layers=2, seed=4, dtype=torch.float32).cuda()
    eager = TorchRunner(m, max_kv_tokens=8192)
    fixed = TorchRunner(m, max_kv_tokens=8192, cuda_graphs=True)
    rng = random.Random(1)
    for b in (1, 3, 8):
        prompts = [[rng.randrange(1, 250) for _ in range(rng.randint(40, 300))] for _ in range(b)]
        te, tf = _prefill(eager, prompts, extra=60), _prefill(fixed, prompts, extra=60)
        lens = [len(p) for p in prompts]
        for _ in range(4):
            feed = [[rng.randrange(1, 250) for _ in range(rng.choice([1, 1, 3, 12]))] for _ in range(b)]
            le, _, _ = eager.forward([SeqInput(f, n, t) for f, n, t in zip(feed, lens, te)])
            lf, _, _ = fixed.forward([SeqInput(f, n, t) for f, n, t in zip(feed, lens, tf)])
            torch.testing.assert_close(lf, le, rtol=1e-4, atol=1e-4)
            lens = [n + len(f) for n, f in zip(lens, feed)]
    g = fixed.graphs
    assert g.error is None and g.captured >= 3 and g.replays == 12


@needs_cuda
@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_cuda_graph_routing_equals_reference(processes):
    from tokenrouter_sdk.random_models import id_tokenizer, random_model, random_prompts

    shrink = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1024,
        eos_token_id=1000,
        bos_token_id=None,
    )
    pair = {
        "small": random_model("qwen3-0.6b", device="cuda", dtype=torch.float64, seed=0, **shrink),
        "large": random_model(
            "qwen3-8b", device="cuda", dtype=torch.float64, seed=1, **(shrink | {"num_hidden_layers": 3})
        ),
    }
    policy, params = RandomRouting(p=0.3, seed=2), SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = random_prompts(8, 20, vocab_size=1024, seed=3, avoid=(1000,))
    with Router(
        pair,
        policy,
        tokenizer=id_tokenizer(1024, eos_token_id=1000),
        cuda_graphs=True,
        processes={"start_timeout": 180.0} if processes else False,
    ) as r:
        outs = r.generate(prompts, sampling=params, concurrency=8, timeout=180)
        if not processes:
            assert all(run.graphs.captured > 0 and run.graphs.error is None for run in r.engine.runners.values())
    for o in outs:
        ref = reference_generate(pair, o.prompt, policy, params, rid=o.rid)
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"])


def test_router_warns_when_graphs_cannot_be_captured(pair, tok):
    with pytest.warns(UserWarning, match="not on a CUDA device"):
        Router(pair, tokenizer=tok, cuda_graphs=True, processes=False).close()
