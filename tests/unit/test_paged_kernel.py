"""An attention backend is one class (`tokenrouter_sdk.backends.attention.PagedKernel`): a kernel
of the test's own, written against the protocol alone (plain torch, one request at a time), handed
to `batch.pack` as a runner hands the CPU kernel, stores the step's new keys and values and attends a step of
decodes and extends with
windows and soft-caps exactly as the gather backend does, and sees only the requests it may
attend (decodes and extends up to its ``max_queries``)."""

import pytest
import torch

from tokenrouter_sdk.backends.attention import AttentionSpec, KernelPart, LayerParams, attend_tokens, pack
from tokenrouter_sdk.engine.core.block_allocator import BlockAllocator
from tokenrouter_sdk.engine.core.kv_pool import KVPool
from tokenrouter_sdk.engine.runner import SeqInput


class LoopKernel:
    """Each request's queries against its keys, gathered by slot, one request at a time."""

    def __init__(self, max_queries: int):
        self.max_queries = max_queries
        self.seen: list[list[int]] = []
        self.stored: list[int] = []

    def store(self, kc, vc, slots, k, v) -> None:
        self.stored.append(len(slots))
        kc[slots] = k
        vc[slots] = v

    def part(self, rows: list) -> KernelPart:
        table = torch.zeros(len(rows), max(r[2] for r in rows), dtype=torch.long)
        for i, (_, _, n, sl) in enumerate(rows):
            table[i, :n] = sl
        cols = torch.tensor([r[:3] for r in rows], dtype=torch.long).T
        return KernelPart(self, table, cols[0], cols[1], cols[2])

    def attend(self, part, p, out, q, kc, vc) -> None:
        self.seen.append(part.q_len.tolist())
        h, hkv = q.shape[1], kc.shape[1]
        for qs, ql, kl, slots in zip(part.q_start.tolist(), part.q_len.tolist(), part.kv_len.tolist(), part.table):
            k = kc[slots[:kl]].repeat_interleave(h // hkv, dim=1)  # [L, H, D]
            v = vc[slots[:kl]].repeat_interleave(h // hkv, dim=1)
            s = torch.einsum("qhd,khd->hqk", q[qs : qs + ql], k) * p.scale  # [H, Q, L]
            if p.softcap:
                s = p.softcap * torch.tanh(s / p.softcap)
            qpos = torch.arange(kl - ql, kl)[:, None]
            kpos = torch.arange(kl)[None, :]
            ok = kpos <= qpos
            if p.window:
                ok &= kpos > qpos - p.window
            s = s.masked_fill(~ok, float("-inf"))
            out[qs : qs + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize(
    "layers",
    [
        (LayerParams(None, None, 0.25),),
        (LayerParams(6, None, 0.3), LayerParams(None, 30.0, 0.2), LayerParams(6, 20.0, 0.25)),
    ],
)
def test_a_kernel_of_its_own_attends_as_the_gather_backend(layers):
    heads, kv_heads, dim = 4, 2, 8
    pool = KVPool(len(layers), kv_heads, dim, num_blocks=40, block_size=4, dtype=torch.float64)
    blocks = BlockAllocator.over(pool)
    g = torch.Generator().manual_seed(0)
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64))
    # (cached, fed): a prefill, two decodes, extends of 3 and 7 tokens
    shapes = [(0, 9), (11, 1), (17, 1), (8, 3), (13, 7)]
    seqs = []
    for cached, fed in shapes:
        table: list[int] = []
        blocks.ensure(table, cached + fed)
        seqs.append(SeqInput([0] * fed, cached, table))
    n = sum(f for _, f in shapes)
    q = torch.randn(n, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(n, kv_heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(n, kv_heads, dim, generator=g, dtype=torch.float64)
    spec = AttentionSpec("test", tuple(layers))
    kernel = LoopKernel(max_queries=3)
    fb_kernel = pack(seqs, pool, spec, "cpu", kernel)[0]
    fb_gather = pack(seqs, pool, spec, "cpu", None)[0]
    for layer in range(len(layers)):
        got = attend_tokens(fb_kernel, layer, q, k, v)
        want = attend_tokens(fb_gather, layer, q, k, v)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # the decodes and the extend of 3 went to the kernel; the prefill and the extend of 7 did not
    assert kernel.seen == [[1, 1, 3]] * len(layers)
    assert kernel.stored == [n] * len(layers)  # the kernel stored every fed token's K/V, once per layer
