"""The CPU kernel backend: decode and short-extend queries attend their cached keys in place in
the pool (``csrc/paged_attention.cpp`` via `tokenrouter_sdk.backends.cpu_kernels`: no per-step
gather, split-K over torch's thread pool), with the layer's window (only keys inside it are read:
a decode at context 8,000 in a 512-key window reads 512 keys), soft-cap and scale. Float32, float64
and bfloat16 pools on a CPU (bfloat16 computed in float32 on the widened values); the step's other
requests go to the gather backend."""

from __future__ import annotations

import torch

from .metadata import KernelPart
from .spec import LayerParams

# Queries of one extend the in-place kernel attends when nothing was measured (more go to SDPA
# over a gathered copy, whose GEMMs beat the kernel's per-query loops once a request feeds many
# tokens); a runner measures its own limit on the machine (`kernel_choice`).
MAX_QUERIES = 16

# keys per split-K task (0: the kernel picks: two tasks per thread at least, 32 to 2,048 keys)
CHUNK = 0

# queries of one request from which the kernel scores 16 keys at a time when nothing was measured;
# a runner measures its own (`kernel_choice.tile_choice`)
TILE_FROM = 4


class CpuKernel:
    """The in-place C++ kernel as a `PagedKernel`.

    Args:
        op: the kernel op (`tokenrouter_sdk.backends.cpu_kernels.paged_attention_op`).
        max_queries: the longest extend (tokens) it attends (`kernel_choice.extend_limit`
            measures it per machine and model shape).
        tile_from: a request of this many queries or more is scored 16 keys at a time (0:
            none; the same bits either way: `kernel_choice.tile_choice` measures the faster).
    """

    def __init__(self, op, max_queries: int = MAX_QUERIES, tile_from: int = TILE_FROM):
        self.op, self.max_queries, self.tile_from = op, max_queries, tile_from
        self.store_op = torch.ops.tokenrouter_cpu.store_kv  # loaded with ``op``

    def part(self, rows: list) -> KernelPart:
        """The `KernelPart` of (q_start, q_len, kv_len, slots [kv_len]) per request."""
        table = torch.zeros(len(rows), max(k[2] for k in rows), dtype=torch.long)
        for i, (_, _, n, sl) in enumerate(rows):
            table[i, :n] = sl
        cols = torch.tensor([k[:3] for k in rows], dtype=torch.long).T.contiguous()
        return KernelPart(self, table, cols[0], cols[1], cols[2])

    def attend(
        self, part: KernelPart, p: LayerParams, out: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
    ) -> None:
        """Write the rows of ``out`` [T, H, D] that ``part``'s requests own: their queries of
        ``q`` [T, H, D] (contiguous) against their keys in one layer's pool kc, vc [slots, Hkv, D]."""
        self.op(
            out,
            q,
            kc,
            vc,
            part.table,
            part.q_start,
            part.q_len,
            part.kv_len,
            p.scale,
            CHUNK,
            p.window or 0,
            p.softcap or 0.0,
            self.tile_from,
        )

    def store(self, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``kc[slots[t]] = k[t]``, ``vc[slots[t]] = v[t]`` in one call: k, v [T, Hkv, D] with
        unit stride in D, slots [T] int64. Raises RuntimeError on a slot outside the pool."""
        self.store_op(
            kc, vc, slots, k if k.stride(-1) == 1 else k.contiguous(), v if v.stride(-1) == 1 else v.contiguous()
        )
