"""How many queries of one extend the in-place CPU kernel attends, measured on the machine.

An extend (a request fed several tokens at once past its cached prefix: a hop returning to a
model, a chat turn, a prompt behind a cached prefix) can be attended by the CPU kernel, which
reads each cached key once per chunk but computes every query's scores in its own loops, or by
the gather backend, which copies the request's keys once and runs one SDPA call whose GEMMs
serve all its queries. Which is faster for ``q`` queries depends on the CPU and the kernel: on a
2-core Zen 5 EPYC, in this measurement's step for the large SmolLM2-135M (30 layers), the kernel
scoring a key at a time was ahead up to 8 queries and behind from 16 (10.6 against 9.0 ms at
16); scoring extends 16 keys at a time, it is ahead at every bucket up to 32 (7.7 against 10.4
ms at 16, 13.6 against 15.7 at 32).

What is measured: a step's attention (every layer of a pool of the model's shapes, 3 decode
requests and one extend of ``q`` queries, ``CONTEXT`` cached keys each, the kernel attending the
decodes in both) with the extend in the kernel and with it in the gather backend, interleaved,
the median of `REPS`, at each of `BUCKETS`. The limit is the largest bucket up to which the
kernel wins at every bucket (1 when it loses at the first: only decodes go to the kernel). An
extend of a count between two buckets takes the lower bucket's verdict.

Kept in the machine's choices file (`tokenrouter_sdk.backends.autotune.choose`) under
`choice_key`; ``TOKENROUTER_KERNEL_EXTEND=<n>`` forces a limit of n queries, ``auto`` (the
default) measures.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from .. import autotune

ENV = "TOKENROUTER_KERNEL_EXTEND"
BUCKETS = (2, 4, 8, 16, 32)
CONTEXT = 512  # cached keys of each request in the measured step
DECODES = 3    # decode requests beside the extend
REPS = 5


def forced_limit() -> int | None:
    """The limit forced by ``TOKENROUTER_KERNEL_EXTEND`` (queries, >= 1), or None (measure).

    Raises:
        ValueError: a value that is neither ``auto`` nor an integer >= 1.
    """
    v = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if v == "auto":
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={v!r}: accepted values are auto or a number of queries >= 1")
    return n


def choice_key(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, layers: int) -> str:
    """``extend kernel float32 heads=9 kv=3 dim=64 layers=30`` style key."""
    return f"extend kernel {str(dtype).removeprefix('torch.')} heads={heads} kv={kv_heads} dim={dim} layers={layers}"


def limit_of(buckets, kernel_wins) -> int:
    """The largest bucket up to which the kernel wins at every bucket, or 1."""
    limit = 1
    for b, win in zip(buckets, kernel_wins):
        if not win:
            break
        limit = int(b)
    return limit


def _valid(entry: dict) -> bool:
    buckets, wins = entry["buckets"], entry["kernel"]
    return (isinstance(entry.get("limit"), int) and entry["limit"] >= 1 and len(buckets) == len(wins) > 0
            and [int(b) for b in buckets] == sorted(set(int(b) for b in buckets))
            and entry["limit"] == limit_of(buckets, wins))


def measure(op, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, layers: int, *, buckets=BUCKETS,
            reps: int = REPS, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Time one step's attention with the extend in the kernel and in the gather backend.

    Args:
        op: the kernel op (`tokenrouter_sdk.backends.cpu_kernels.paged_attention_op`).
        heads, kv_heads, dim: the model's query heads, KV heads and head size.
        dtype: the KV pool's dtype.
        layers: layers attended per step.
        buckets: extend lengths (queries) to time, ascending.
        reps: timed steps per path and bucket, after one untimed step each.
        clock: seconds.

    Returns:
        ``{"buckets", "kernel" (per bucket: the kernel was faster), "kernel_ms", "gather_ms"
        (medians per step), "limit", "context", "decodes", "layers"}``.
    """
    from ...engine.block_allocator import BlockAllocator
    from ...engine.kv_pool import KVPool
    from ...engine.runner import SeqInput
    from .batch import pack
    from .cpu_kernel import CpuKernel
    from .interface import attend_tokens
    from .spec import AttentionSpec

    top = max(buckets)
    per = -(-(CONTEXT + top) // 16)
    pool = KVPool(layers, kv_heads, dim, num_blocks=per * (DECODES + 1), block_size=16, dtype=dtype)
    blocks = BlockAllocator.over(pool)
    g = torch.Generator().manual_seed(0)
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape, generator=g, dtype=dtype))
    tables = [[] for _ in range(DECODES + 1)]
    for tb in tables:
        blocks.ensure(tb, CONTEXT + top)
    spec = AttentionSpec.uniform("measured", layers, dim ** -0.5)
    kernel_ms, gather_ms = [], []
    with torch.inference_mode():
        for q in buckets:
            seqs = [SeqInput([0] * q, CONTEXT, tables[0])] + [SeqInput([0], CONTEXT, tb) for tb in tables[1:]]
            n = q + DECODES
            x = torch.randn(n, heads, dim, generator=g, dtype=dtype)
            kv = torch.randn(n, kv_heads, dim, generator=g, dtype=dtype)
            batches = [pack(seqs, pool, spec, "cpu", CpuKernel(op, q))[0],
                       pack(seqs, pool, spec, "cpu", CpuKernel(op, q - 1))[0]]

            def step(fb):
                for layer in range(layers):
                    attend_tokens(fb, layer, x, kv, kv)
            times: list[list[float]] = [[], []]
            for fb in batches:
                step(fb)
            for _ in range(reps):  # interleaved: a drift of the machine hits both alike
                for i, fb in enumerate(batches):
                    t0 = clock()
                    step(fb)
                    times[i].append(clock() - t0)
            kernel_ms.append(1e3 * statistics.median(times[0]))
            gather_ms.append(1e3 * statistics.median(times[1]))
    pool.release()
    wins = [a < b for a, b in zip(kernel_ms, gather_ms)]
    return {"buckets": list(buckets), "kernel": wins, "kernel_ms": [round(v, 4) for v in kernel_ms],
            "gather_ms": [round(v, 4) for v in gather_ms], "limit": limit_of(buckets, wins),
            "context": CONTEXT, "decodes": DECODES, "layers": layers}


def extend_limit(op, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, layers: int, *,
                 measure_fn=measure, fields: dict | None = None) -> tuple[int, str]:
    """The most queries of one extend the kernel attends for a model of these shapes: forced by
    ``TOKENROUTER_KERNEL_EXTEND``, else this machine's stored choice, else measured and stored.

    Returns:
        (limit in queries >= 1, source: ``forced (...)``, ``cached``, ``measured`` or
        ``measured (not stored)``).

    Raises:
        ValueError: ``TOKENROUTER_KERNEL_EXTEND`` holds a bad value.
    """
    forced = forced_limit()
    if forced is not None:
        return forced, f"forced ({ENV}={forced})"
    entry, source = autotune.choose(choice_key(heads, kv_heads, dim, dtype, layers),
                                    lambda: measure_fn(op, heads, kv_heads, dim, dtype, layers), _valid, fields=fields)
    return int(entry["limit"]), source


def describe(key: str, entry: dict) -> str | None:
    """A `tokenrouter info` line for a stored extend choice, or None when ``entry`` is not one."""
    try:
        if not key.startswith("extend kernel") or not _valid(entry):
            return None
        times = ", ".join(f"{b}: {a:.2f}/{c:.2f}" for b, a, c in zip(entry["buckets"], entry["kernel_ms"], entry["gather_ms"]))
    except (KeyError, TypeError, ValueError):
        return None
    return (f"{key}: the kernel attends extends of up to {entry['limit']} queries (ms per step of "
            f"{entry.get('layers', '?')} layers, {entry.get('decodes', '?')} decodes + one extend at "
            f"{entry.get('context', '?')} keys, kernel/gather by queries: {times})")

