"""The C++ CPU kernels (`tokenrouter_sdk.backends.cpu_kernels`). The in-place paged attention: against
attention computed from first principles over the gathered keys (decodes, extends, grouped-query
heads, contexts split into several chunks, float32 and float64, both code paths of the dot
product, sliding windows and logit soft-caps); rows it does not own stay untouched; bad inputs raise; a runner's
steps equal the
gather path's; routed generation with it equals the naive reference. The fused float32 step ops
(RMSNorm, rotary embedding, SiLU gating) equal their ATen formulas on strided inputs."""

import random
import shutil

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.backends import cpu_kernels
from tokenrouter_sdk.backends.attention import cpu_kernel, kernel_choice
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.config import EngineConfig
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import tiny_model
from tokenrouter_sdk.policies import RandomRouting

from .test_native_forward import routed_float32_run_equals_reference

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the kernel cannot be built here (steps gather)",
)


@pytest.fixture(scope="module")
def op():
    op = cpu_kernels.paged_attention_op(wait=True, timeout=600)
    assert op is not None, cpu_kernels.error()
    return op


def _reference(q, kc, vc, table, q_start, q_len, kv_len, scale, window=0, softcap=0.0):
    """Per request and query: softmax(q k^T * scale) v over the visible keys (the last
    ``window`` of them with a window; scores soft-capped with ``softcap``), in float64."""
    out = {}
    g = q.shape[1] // kc.shape[1]
    for r in range(table.shape[0]):
        n, L = int(q_len[r]), int(kv_len[r])
        k = kc[table[r, :L]].double().repeat_interleave(g, 1)  # [L, H, D]
        v = vc[table[r, :L]].double().repeat_interleave(g, 1)
        for t in range(n):
            row = int(q_start[r]) + t
            seen = L - n + t + 1
            lo = max(0, seen - window) if window else 0
            s = torch.einsum("hd,lhd->hl", q[row].double(), k[lo:seen]) * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            out[row] = torch.einsum("hl,lhd->hd", s.softmax(-1), v[lo:seen])
    return out


def _case(dtype, h, hkv, d, reqs, seed=0, slots=4096):
    """A pool of ``slots`` slots with requests of (q_len, kv_len) in shuffled slots."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(slots, hkv, d, dtype=dtype, generator=g)
    vc = torch.randn(slots, hkv, d, dtype=dtype, generator=g)
    perm = torch.randperm(slots, generator=g)
    lmax = max(L for _, L in reqs)
    table = torch.zeros(len(reqs), lmax, dtype=torch.long)
    used = 0
    for i, (_, L) in enumerate(reqs):
        table[i, :L] = perm[used : used + L]
        used += L
    q_len = torch.tensor([n for n, _ in reqs])
    q_start = torch.cumsum(q_len, 0) - q_len + 2  # rows 0 and 1 belong to no request
    t = int(q_start[-1] + q_len[-1]) + 1
    q = torch.randn(t, h, d, dtype=dtype, generator=g)
    return q, kc, vc, table, q_start, q_len, torch.tensor([L for _, L in reqs])


@pytest.mark.parametrize("chunk", [0, 32, 100])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 4, 24), (8, 2, 16), (16, 1, 128), (14, 2, 48)])
def test_kernel_equals_attention_from_first_principles(op, dtype, tol, h, hkv, d, chunk):
    """Decodes of 1 to 1,100 keys, extends of 2, 3 and 16 queries; ``chunk`` 0 (the kernel's own
    choice), or 32 and 100 keys, so that contexts split into many chunks and extends' causal
    limits fall inside and across chunk boundaries."""
    reqs = [(1, 1), (1, 17), (1, 300), (3, 40), (1, 1100), (16, 530), (2, 2), (16, 16)]
    q, kc, vc, table, q_start, q_len, kv_len = _case(dtype, h, hkv, d, reqs)
    out = torch.full_like(q, 7.0)
    scale = d**-0.5
    op(out, q, kc, vc, table, q_start, q_len, kv_len, scale, chunk)
    ref = _reference(q, kc, vc, table, q_start, q_len, kv_len, scale)
    for row, want in ref.items():
        torch.testing.assert_close(out[row].double(), want, rtol=tol, atol=tol)
    owned = set(ref)
    for row in range(q.shape[0]):
        if row not in owned:
            assert (out[row] == 7.0).all(), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk", [0, 2048])
def test_the_softmax_maximum_is_found_wherever_the_largest_score_lies(op, dtype, chunk):
    """One key scores 300 (its exponential overflows float32 unless the largest score is taken
    off), every other 0: the output is that key's value row wherever it lies, in the 16-lane
    part of a chunk's scores, at its edge, or in the rest past the last full 16."""
    h, hkv, d, scale = 9, 3, 64, 0.125
    for L in (1, 15, 16, 17, 31, 32, 33, 47, 200):
        for p in sorted({0, L // 2, L - 1, max(0, L // 16 * 16 - 1), min(L - 1, L // 16 * 16)}):
            q, kc, vc, table, q_start, q_len, kv_len = _case(dtype, h, hkv, d, [(1, L)], seed=L)
            q.zero_()
            q[:, :, 0] = 1
            kc[:, :, 0] = 0
            kc[table[0, p], :, 0] = 300 / scale
            out = torch.full_like(q, 7.0)
            op(out, q, kc, vc, table, q_start, q_len, kv_len, scale, chunk)
            want = vc[table[0, p]].repeat_interleave(h // hkv, 0)
            torch.testing.assert_close(out[int(q_start[0])], want, rtol=0, atol=0, msg=f"L={L}, p={p}")


@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("window", [1, 7, 64, 300])
@pytest.mark.parametrize("chunk", [0, 5, 32])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_kernel_windows_and_softcap_equal_first_principles(op, dtype, tol, chunk, window, softcap):
    """A sliding window (each query sees its last ``window`` keys, its own included) and a logit
    soft-cap, for decodes and extends whose windows start inside, across and before chunk
    boundaries; the keys outside every query's window are NaN in the pool, so a kernel that used
    any of them would give NaN."""
    reqs = [(1, 1), (1, 17), (1, 300), (3, 40), (1, 1100), (16, 530), (2, 2), (16, 16)]
    q, kc, vc, table, q_start, q_len, kv_len = _case(dtype, 8, 2, 16, reqs, seed=4)
    q = q * 3  # scores large enough for the soft-cap to bite
    for r, (n, L) in enumerate(reqs):
        first = max(0, L - n + 1 - window)
        kc[table[r, :first]] = float("nan")
        vc[table[r, :first]] = float("nan")
    out = torch.full_like(q, 7.0)
    op(out, q, kc, vc, table, q_start, q_len, kv_len, 0.25, chunk, window, softcap)
    ref = _reference(q, kc, vc, table, q_start, q_len, kv_len, 0.25, window, softcap)
    for row, want in ref.items():
        torch.testing.assert_close(out[row].double(), want, rtol=tol, atol=tol)
    if softcap and window > 1:  # the cap bites (one key per query: the softmax is 1 whatever the score)
        plain = _reference(q, kc, vc, table, q_start, q_len, kv_len, 0.25, window)
        assert max((plain[r] - ref[r]).abs().max().item() for r in ref) > 1e-3


@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (8, 2, 16), (16, 1, 128), (6, 3, 48)])
@pytest.mark.parametrize("n,L,chunk", [(16, 530, 64), (4, 37, 1000), (7, 300, 5), (33, 33, 16), (5, 1100, 0)])
def test_an_extend_has_the_bits_of_its_queries_as_decodes(op, h, hkv, d, n, L, chunk, softcap):
    """float32: the queries of one extend (scored 16 keys at a time from ``tile_from`` queries, 4 by
    default, and at any other threshold) give the same bits as each query decoded alone over the
    keys it sees (one query: a dot per key). The keys
    are split into the same chunks both ways (``chunk`` keys from the first; 0: the kernel's own
    choice, which must then be one chunk for the decodes too), and the extend's causal limits
    cut tiles of 16 keys at every offset."""
    q, kc, vc, table, q_start, q_len, kv_len = _case(torch.float32, h, hkv, d, [(n, L)], seed=n)
    q = q * 3
    if chunk == 0:
        chunk = L  # one chunk each way (the kernel's own split depends on the request count)
    out = torch.zeros_like(q)
    op(out, q, kc, vc, table, q_start, q_len, kv_len, d**-0.5, chunk, 0, softcap)
    for tile_from in (0, 1, n, n + 1):  # never, always, from this extend's length, from just past it
        again = torch.zeros_like(q)
        op(again, q, kc, vc, table, q_start, q_len, kv_len, d**-0.5, chunk, 0, softcap, tile_from)
        assert torch.equal(again, out), tile_from
    one = torch.ones(n, dtype=torch.long)
    dec = torch.zeros_like(q)
    op(
        dec,
        q,
        kc,
        vc,
        table.expand(n, -1).contiguous(),
        q_start[0] + torch.arange(n),
        one,
        L - n + 1 + torch.arange(n),
        d**-0.5,
        chunk,
        0,
        softcap,
    )
    rows = slice(int(q_start[0]), int(q_start[0]) + n)
    assert torch.equal(out[rows], dec[rows]), (out[rows] - dec[rows]).abs().max().item()
    ref = _reference(q, kc, vc, table, q_start, q_len, kv_len, d**-0.5, 0, softcap)
    for row, want in ref.items():
        torch.testing.assert_close(out[row].double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("window,chunk", [(0, 0), (0, 32), (7, 0), (64, 5), (300, 100)])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 4, 24), (8, 2, 16), (16, 1, 128), (14, 2, 48)])
def test_bfloat16_pools_have_the_bits_of_float32_on_their_widened_values(op, h, hkv, d, window, chunk, softcap):
    """bfloat16 q and pools are read in place and computed in float32: the output equals the
    float32 kernel (per-key scores, no tiles) run on the widened values, rounded to bfloat16, bit
    for bit, for decodes and extends of every head dim (a multiple of 16 or not); within bfloat16
    rounding of attention from first principles; rows of no request untouched."""
    reqs = [(1, 37), (1, 200), (5, 90), (16, 530), (3, 3)]
    q, kc, vc, table, q_start, q_len, kv_len = _case(torch.bfloat16, h, hkv, d, reqs, seed=7)
    out = torch.zeros_like(q)
    op(out, q, kc, vc, table, q_start, q_len, kv_len, 0.125, chunk, window, softcap, 4)
    wide = torch.zeros(q.shape)
    op(wide, q.float(), kc.float(), vc.float(), table, q_start, q_len, kv_len, 0.125, chunk, window, softcap, 0)
    assert torch.equal(out, wide.bfloat16())
    assert (out[:2] == 0).all()
    for row, want in _reference(q, kc, vc, table, q_start, q_len, kv_len, 0.125, window, softcap).items():
        torch.testing.assert_close(out[row].double(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("reqs", [[(1, 700), (1, 5), (4, 90)], [(16, 1000)]])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_is_the_same_on_any_thread_count(op, threads, reqs):
    """The kernel's own chunking follows the thread count (one request: 2 chunks per thread)."""
    q, kc, vc, table, q_start, q_len, kv_len = _case(torch.float64, 6, 2, 32, reqs)
    ref = _reference(q, kc, vc, table, q_start, q_len, kv_len, 0.3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.zeros_like(q)
        op(out, q, kc, vc, table, q_start, q_len, kv_len, 0.3)
    finally:
        torch.set_num_threads(before)
    for row, want in ref.items():
        torch.testing.assert_close(out[row], want, rtol=1e-12, atol=1e-12)


def test_kernel_rejects_what_does_not_fit(op):
    q, kc, vc, table, q_start, q_len, kv_len = _case(torch.float32, 4, 2, 16, [(2, 10)])
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(out, q, kc, vc, table, q_start, q_len, torch.tensor([1]), 1.0)  # 2 queries, 1 key
    with pytest.raises(RuntimeError, match="do not fit"):
        op(out, q, kc, vc, table, q_start, q_len, torch.tensor([11]), 1.0)  # more keys than the table
    with pytest.raises(RuntimeError, match="float32, float64 and bfloat16"):
        op(out.half(), q.half(), kc.half(), vc.half(), table, q_start, q_len, kv_len, 1.0)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(out, q, kc.double(), vc.double(), table, q_start, q_len, kv_len, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        op(out, q, kc, vc, table.int(), q_start, q_len, kv_len, 1.0)
    with pytest.raises(RuntimeError, match="chunk must be"):
        op(out, q, kc, vc, table, q_start, q_len, kv_len, 1.0, -1)
    with pytest.raises(RuntimeError, match="window must be"):
        op(out, q, kc, vc, table, q_start, q_len, kv_len, 1.0, 0, -1)
    with pytest.raises(RuntimeError, match="softcap must be"):
        op(out, q, kc, vc, table, q_start, q_len, kv_len, 1.0, 0, 0, -2.0)
    with pytest.raises(RuntimeError, match="tile_from"):
        op(out, q, kc, vc, table, q_start, q_len, kv_len, 1.0, 0, 0, 0.0, -1)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(out, q.transpose(0, 1).contiguous().transpose(0, 1), kc, vc, table, q_start, q_len, kv_len, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_storing_keys_and_values_equals_index_copy(op, dtype):
    """The kernel backend writes a step's K/V into the pool in one call: the same rows as
    ``index_copy_`` from strided q/k/v views of one projection output; a slot outside the pool is
    refused by name before anything is written."""
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(50, 3, 16, generator=g, dtype=dtype), torch.randn(50, 3, 16, generator=g, dtype=dtype)
    qkv = torch.randn(7, 5 * 16 + 2 * 3 * 16, generator=g, dtype=dtype)
    k = qkv[:, 80:128].view(7, 3, 16)
    v = qkv[:, 128:].view(7, 3, 16)
    slots = torch.tensor([4, 0, 49, 17, 18, 30, 2])
    want_k, want_v = kc.clone().index_copy_(0, slots, k), vc.clone().index_copy_(0, slots, v)
    kern = cpu_kernel.CpuKernel(op)
    kern.store(kc, vc, slots, k, v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    kern.store(kc, vc, slots[:2], k[:2].transpose(1, 2).contiguous().transpose(1, 2), v[:2])  # D not unit-stride
    assert torch.equal(kc, want_k)
    before = kc.clone()
    with pytest.raises(RuntimeError, match="outside the pool"):
        kern.store(kc, vc, torch.tensor([1, 2, 3, 4, 5, 6, 50]), k, v)
    assert torch.equal(kc, before)
    with pytest.raises(RuntimeError, match="one dtype"):
        kern.store(kc, vc, slots, k.to(torch.float16), v.to(torch.float16))
    with pytest.raises(RuntimeError, match="float32, float64 or bfloat16"):
        kern.store(kc.half(), vc.half(), slots, k.half(), v.half())


def _feeds(rng, b, steps):
    feeds = [[[rng.randrange(3, 250) for _ in range(rng.randint(2, 300))] for _ in range(b)]]
    for _ in range(steps):
        feeds.append([[rng.randrange(3, 250) for _ in range(rng.choice([1, 1, 1, 3, 16, 20]))] for _ in range(b)])
    return feeds


def _steps(runners: dict, feeds):
    """Each runner fed the same ``feeds`` (per step, one token list per request), each request in
    blocks of its own: yields per step ``{name: the runner's step output}``."""
    n = len(feeds[0])
    tabs = {a: [[] for _ in range(n)] for a in runners}
    starts = [0] * n
    for feed in feeds:
        outs = {}
        for a, r in runners.items():
            for t, s, f in zip(tabs[a], starts, feed):
                blocks_of(r).ensure(t, s + len(f))
            outs[a] = r.forward([SeqInput(f, s, t) for f, s, t in zip(feed, starts, tabs[a])])
        yield outs
        starts = [s + len(f) for s, f in zip(starts, feed)]


@pytest.mark.parametrize(
    "model_impl,dtype,tol",
    [("native", torch.float64, 1e-11), ("transformers", torch.float64, 1e-11), ("native", torch.float32, 1e-4)],
)
def test_runner_steps_with_the_kernels_equal_the_aten_steps(op, model_impl, dtype, tol, monkeypatch):
    """Prefill, then decodes, extends of 3 and 16 tokens (kernel) and of 20 (gather), mixed in
    one batch: logits and hidden states within rounding (float32 native steps also run the fused
    step ops), and the kernel ran."""
    calls = []
    real = cpu_kernel.CpuKernel.attend
    monkeypatch.setattr(
        cpu_kernel.CpuKernel, "attend", lambda self, kern, *a: calls.append(kern.q_len.tolist()) or real(self, kern, *a)
    )
    monkeypatch.setenv(kernel_choice.ENV, str(cpu_kernel.MAX_QUERIES))  # extends of up to 16 in the kernel
    monkeypatch.setenv(kernel_choice.TILES_ENV, "4")  # forced: no measurement's extends among the calls
    model = tiny_model(num_layers=3, seed=21, dtype=dtype)
    runners = {a: TorchRunner(model, max_kv_tokens=8192, kernels=a, model_impl=model_impl) for a in ("wait", "off")}
    for outs in _steps(runners, _feeds(random.Random(3), 4, 6)):
        torch.testing.assert_close(outs["wait"].logits, outs["off"].logits, rtol=tol, atol=tol)
        torch.testing.assert_close(outs["wait"].hidden, outs["off"].hidden, rtol=tol, atol=tol)
    assert calls, "the kernel never ran"
    assert all(n <= cpu_kernel.MAX_QUERIES for c in calls for n in c)
    assert any(n > 1 for c in calls for n in c), "no extend went through the kernel"


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_bfloat16_steps_with_the_kernel_are_as_close_to_float64_as_the_aten_steps(op, model_impl, monkeypatch):
    """A bfloat16 model's steps (prefill, decodes, extends in the kernel and past it) attend in
    place with the kernel (native steps also run the fused bfloat16 step ops), and their logits are
    as close to the float64 steps of the same weights as the ATen bfloat16 steps (worst and mean
    error within 1.5x of theirs), at every step."""
    calls = []
    real = cpu_kernel.CpuKernel.attend
    monkeypatch.setattr(
        cpu_kernel.CpuKernel, "attend", lambda self, kern, *a: calls.append(kern.q_len.tolist()) or real(self, kern, *a)
    )
    norms = []
    real_norm = cpu_kernels.StepOps.rms_norm
    monkeypatch.setattr(
        cpu_kernels.StepOps, "rms_norm", staticmethod(lambda x, n: norms.append(x.dtype) or real_norm(x, n))
    )
    monkeypatch.setenv(kernel_choice.ENV, str(cpu_kernel.MAX_QUERIES))
    monkeypatch.setenv(kernel_choice.TILES_ENV, "4")
    model = tiny_model(num_layers=3, seed=21, dtype=torch.bfloat16)
    wide = tiny_model(num_layers=3, seed=21, dtype=torch.bfloat16).double()  # the same weights, widened
    runners = {
        "wait": TorchRunner(model, max_kv_tokens=8192, kernels="wait", model_impl=model_impl),
        "off": TorchRunner(model, max_kv_tokens=8192, kernels="off", model_impl=model_impl),
        "ref": TorchRunner(wide, max_kv_tokens=8192, kernels="off", model_impl=model_impl),
    }
    for outs in _steps(runners, _feeds(random.Random(3), 4, 6)):
        err = {a: (outs[a].logits.double() - outs["ref"].logits.double()).abs() for a in ("wait", "off")}
        assert err["wait"].max() <= 1.5 * err["off"].max() + 1e-3, (err["wait"].max(), err["off"].max())
        assert err["wait"].mean() <= 1.5 * err["off"].mean() + 1e-4, (err["wait"].mean(), err["off"].mean())
    assert any(n == 1 for c in calls for n in c) and any(n > 1 for c in calls for n in c), calls
    assert (set(norms) == {torch.bfloat16}) == (model_impl == "native"), norms  # the fused step ops: native steps


def test_kernels_choice_is_checked_and_passed_on(pair, tok):
    with pytest.raises(ValueError, match="kernels must be one of"):
        TorchRunner(pair["large"], max_kv_tokens=64, kernels="flash")
    with pytest.raises(ValueError, match="kernels must be one of"):
        EngineConfig(kernels="flash")
    with Router(pair, RandomRouting(p=0.3), tokenizer=tok, max_kv_tokens=512, kernels="off") as r:
        assert {x.kernels for x in r.engine.runners.values()} == {"off"}
        batch = r.engine.runners["large"]
        tb = []
        blocks_of(batch).ensure(tb, 3)
        fb = batch._batch([SeqInput([5], 2, tb)])[0]
        assert fb.kern is None and fb.dec is not None


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_routed_generation_with_the_kernel_equals_reference(tok, op, mode):
    """float32 pair with the kernels (returns are extends, float32 steps run the fused ops):
    routed greedy output equals the naive reference."""
    routed_float32_run_equals_reference(tok, mode, kernels="wait", processes=False)


def test_step_ops_equal_their_aten_formulas(op):
    ops = cpu_kernels.step_ops()
    g = torch.Generator().manual_seed(5)
    norm = torch.nn.Module()
    norm.weight, norm.variance_epsilon = torch.randn(96, generator=g), 1e-6
    x = torch.randn(5, 3 * 96, generator=g)[:, 96:192]  # rows with a stride
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(ops.rms_norm(x, norm), want, rtol=1e-5, atol=1e-5)
    t = torch.randn(4, 10, 3, 32, generator=g)[:, :, 1]  # [T, H, D], strided rows
    cos, sin = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    out = ops.rope(t, cos, sin)
    torch.testing.assert_close(out, t * cos[:, None] + torch.roll(t, 16, -1) * sin[:, None], rtol=1e-5, atol=1e-5)
    assert out.is_contiguous()
    gu = torch.randn(3, 2 * 40, generator=g)
    gate, up = gu.split(40, -1)
    torch.testing.assert_close(ops.silu_mul(gate, up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_mul(gate.double(), up.double())
    with pytest.raises(RuntimeError, match="even head size"):
        ops.rope(torch.randn(2, 1, 5), torch.randn(2, 5), torch.randn(2, 5))


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most bfloat16 steps between a and b (bfloat16 tensors of finite values), element-wise:
    the distance of their bit patterns as ordered integers."""

    def ordered(t):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)

    return int((ordered(a) - ordered(b)).abs().max())


def test_bfloat16_step_ops_take_the_roundings_of_the_aten_ops(op):
    """bfloat16 step ops: rope has the ATen formula's bits (each product rounded, then the sum);
    rms_norm equals the native forward's bfloat16 RMSNorm and silu_mul ATen's bfloat16 SiLU then
    product within one bfloat16 step (their float32 parts add in another order), almost
    everywhere the same bits; a float32 weight for a bfloat16 row is refused by name."""
    from tokenrouter_sdk.backends.native_forward import rms_norm as aten_rms_norm

    ops = cpu_kernels.step_ops()
    g = torch.Generator().manual_seed(6)
    bf = torch.bfloat16
    t = torch.randn(6, 10, 3, 64, generator=g).to(bf)[:, :, 1]  # [T, H, D], strided rows
    cos, sin = torch.randn(6, 64, generator=g).to(bf), torch.randn(6, 64, generator=g).to(bf)
    out = ops.rope(t, cos, sin)
    assert out.dtype == bf and out.is_contiguous()
    assert torch.equal(out, t * cos[:, None] + torch.roll(t, 32, -1) * sin[:, None])
    norm = torch.nn.Module()
    norm.weight, norm.variance_epsilon = torch.randn(576, generator=g).to(bf), 1e-5
    x = (torch.randn(9, 3 * 576, generator=g) * 3).to(bf)[:, 576:1152]  # rows with a stride
    got, want = ops.rms_norm(x, norm), aten_rms_norm(x, norm)
    assert got.dtype == bf and _bf16_ulps(got, want) <= 1 and (got == want).float().mean() > 0.99
    gu = (torch.randn(8, 2 * 1536, generator=g) * 4).to(bf)
    gate, up = gu.split(1536, -1)
    got, want = ops.silu_mul(gate, up), torch.nn.functional.silu(gate).mul_(up)
    assert got.dtype == bf and _bf16_ulps(got, want) <= 1 and (got == want).float().mean() > 0.99
    with pytest.raises(RuntimeError, match="of the first input's dtype"):
        ops.rms_norm(x, type("N", (), {"weight": norm.weight.float(), "variance_epsilon": 1e-5})())


def test_silu_gating_is_accurate_over_the_whole_float_range(op):
    """The fused SiLU gating computes its exponential in vectorized float arithmetic
    (``csrc/vec_math.h``): within a few float32 ulps of float64 over every magnitude, exact at
    the ends (large negative gates give 0, large positive ones the gate itself), NaN kept."""
    ops = cpu_kernels.step_ops()
    g = torch.cat(
        [
            torch.linspace(-120, 120, 48001),
            torch.logspace(-30, 2, 2000),
            -torch.logspace(-30, 2, 2000),
            torch.tensor([0.0, -0.0, 87.3, -87.3, 88.4, -88.4, 1e30, -1e30]),
        ]
    )
    g = g[: g.numel() // 16 * 16].reshape(-1, 16)
    up = torch.ones_like(g)
    got, want = ops.silu_mul(g, up).double(), torch.nn.functional.silu(g.double())
    normal = want.abs() > 1e-30  # below, float32 holds no more than noise: there, 0 within 1e-30
    ulp = (got - want).abs()[normal] / torch.finfo(torch.float32).eps / want.abs()[normal]
    assert ulp.max().item() < 4, ulp.max().item()
    assert (got - want).abs()[~normal].max().item() < 1e-30
    big = torch.tensor([[-100.0, -1e30, 100.0, 1e30, float("nan"), 0.0, 1.0, -1.0] * 2])
    out = ops.silu_mul(big, torch.ones_like(big))
    assert out[0, :4].tolist() == big[0, :4].clamp_min(0).tolist()  # 0, 0, 100, 1e30
    assert torch.isnan(out[0, 4]) and out[0, 5].item() == 0.0


def test_a_lock_file_left_by_a_killed_builder_does_not_block_the_next(op, tmp_path):
    """torch's build lock file, left behind by a builder killed mid-build, would make every later
    load wait for ever: a fresh process loads the kernels within the timeout all the same."""
    import subprocess
    import sys

    lock = cpu_kernels.build_directory(cpu_kernels.build_name()) / "lock"
    lock.write_text("")
    code = (
        "from tokenrouter_sdk.backends import cpu_kernels as c\n"
        "assert c.paged_attention_op(wait=True, timeout=100) is not None, c.error()\nprint('loaded')"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "loaded" in p.stdout, p.stderr[-2000:]
    assert not lock.exists()


def test_the_build_compiles_its_own_copies_of_the_sources(op):
    """ninja rebuilds when a source's path in its build file changes: the cached library must
    name copies kept with the build, not this checkout's files, or two checkouts with the same
    sources (one build name) would rebuild it in turn at every load."""
    d = cpu_kernels.build_directory(cpu_kernels.build_name())
    ninja = (d / "build.ninja").read_text()
    for s in cpu_kernels.SOURCES:
        assert str(d / "src" / s.name) in ninja
        assert str(s) not in ninja
        assert (d / "src" / s.name).read_bytes() == s.read_bytes()
    for h in cpu_kernels.HEADERS:  # the headers the sources include sit beside the copies
        assert (d / "src" / h.name).read_bytes() == h.read_bytes()


def test_a_changed_header_is_another_build(tmp_path, monkeypatch):
    import shutil

    name = cpu_kernels.build_name()
    copies = []
    for h in cpu_kernels.HEADERS:
        shutil.copy(h, tmp_path / h.name)
        copies.append(tmp_path / h.name)
    monkeypatch.setattr(cpu_kernels, "HEADERS", tuple(copies))
    assert cpu_kernels.build_name() == name
    copies[0].write_text(copies[0].read_text() + "\n// changed\n")
    assert cpu_kernels.build_name() != name


def test_another_environment_is_another_build(tmp_path, monkeypatch):
    """The build file names torch's and Python's include folders: two environments (venvs) with the
    same torch version and sources get their own builds, so neither rebuilds the other's in turn."""
    import sysconfig

    name = cpu_kernels.build_name()
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other_venv" / "torch" / "__init__.py"))
    assert cpu_kernels.build_name() != name
    monkeypatch.undo()
    assert cpu_kernels.build_name() == name
    paths = dict(sysconfig.get_paths(), include=str(tmp_path / "include"))
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: paths)
    assert cpu_kernels.build_name() != name


def test_staging_sources_leaves_unchanged_copies_alone_and_replaces_changed_ones(tmp_path, monkeypatch):
    """The same bytes staged from two places keep one path and one modification time (so ninja
    sees nothing new); other bytes replace the copy."""
    import os
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    for where in (a, b):
        where.mkdir()
        for s in cpu_kernels.SOURCES:
            shutil.copy(s, where / s.name)
    build = tmp_path / "build"
    monkeypatch.setattr(cpu_kernels, "SOURCES", tuple(a / s.name for s in cpu_kernels.SOURCES))
    first = cpu_kernels.stage_sources(build)
    stamps = [os.stat(p).st_mtime_ns for p in first]
    monkeypatch.setattr(cpu_kernels, "SOURCES", tuple(b / s.name for s in cpu_kernels.SOURCES))
    second = cpu_kernels.stage_sources(build)
    assert second == first == [build / "src" / p.name for p in cpu_kernels.SOURCES]
    assert [os.stat(p).st_mtime_ns for p in second] == stamps
    (b / cpu_kernels.SOURCES[0].name).write_text("// changed\n")
    cpu_kernels.stage_sources(build)
    assert first[0].read_text() == "// changed\n"
    assert first[1].read_bytes() == (a / first[1].name).read_bytes()
