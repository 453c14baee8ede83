"""How many queries of one extend the in-place CPU kernel attends, measured on the machine.

An extend (a request fed several tokens at once past its cached prefix: a hop returning to a
model, a chat turn, a prompt behind a cached prefix) can be attended by the CPU kernel, which
reads each cached key once per chunk but computes every query's scores in its own loops, or by
the gather backend, which copies the request's keys once and runs one SDPA call whose GEMMs
serve all its queries. Which is faster for ``q`` queries depends on the CPU and on how the
kernel scores the extend (a key at a time or 16 at a time), so it is measured on the machine
(what it measured on the CPUs this project ran on: ``docs/benchmarks.md``, "Extend limit and
tiles (kernel_choice)").

What is measured: a step's attention (every layer of a pool of the model's shapes, 3 decode
requests and one extend of ``q`` queries, ``CONTEXT`` cached keys each, the kernel attending the
decodes in both) with the extend in the kernel and with it in the gather backend, interleaved,
the median of `REPS`, at each of `BUCKETS`. The limit is the largest bucket up to which the
kernel wins at every bucket (1 when it loses at the first: only decodes go to the kernel). An
extend of a count between two buckets takes the lower bucket's verdict.

Kept in the machine's choices file (`tokenrouter_sdk.backends.autotune.choose`) under
`choice_key`; ``TOKENROUTER_KERNEL_EXTEND=<n>`` forces a limit of n queries, ``auto`` (the
default) measures; any other value raises ValueError naming the accepted ones.

The kernel's own second choice, from how many queries a request is scored 16 keys at a time
(float32 and bfloat16: the same bits as a dot per key; fewer loads and shuffles per score, but the tile order
streams keys from memory more slowly, so it pays only with enough queries): measured by
`measure_tiles` in the same step, each of `TILE_BUCKETS` with the extend's scores tiled and not,
interleaved; ``tile_from`` is the smallest bucket from which tiles win at every larger bucket (0:
they lose at the largest; never). Only float32 and bfloat16 pools on a CPU with AVX-512 have
tiles; any other gets 0 unmeasured. Kept under `tiles_key`;
``TOKENROUTER_KERNEL_TILES=<n>`` forces n (0: never), ``auto`` measures. The extend limit is
measured with the chosen tiles.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from .. import autotune

ENV = "TOKENROUTER_KERNEL_EXTEND"
TILES_ENV = "TOKENROUTER_KERNEL_TILES"
BUCKETS = (2, 4, 8, 16, 32)
TILE_BUCKETS = (2, 3, 4, 6, 8, 16)
CONTEXT = 512  # cached keys of each request in the measured step
DECODES = 3  # decode requests beside the extend
REPS = 5


def _forced(env: str, least: int, accepted: str) -> int | None:
    """The integer >= ``least`` in environment variable ``env``, or None for ``auto`` (or unset).

    Raises:
        ValueError: any other value (the message lists ``accepted``).
    """
    v = os.environ.get(env, "auto").strip().lower() or "auto"
    if v == "auto":
        return None
    try:
        n = int(v)
    except ValueError:
        n = least - 1
    if n < least:
        raise ValueError(f"{env}={v!r}: accepted values are {accepted}")
    return n


def forced_limit() -> int | None:
    """The limit forced by ``TOKENROUTER_KERNEL_EXTEND`` (queries, >= 1), or None (measure).

    Raises:
        ValueError: a value that is neither ``auto`` nor an integer >= 1.
    """
    return _forced(ENV, 1, "auto or a number of queries >= 1")


def forced_tiles() -> int | None:
    """The tile threshold forced by ``TOKENROUTER_KERNEL_TILES`` (queries, >= 0; 0: never), or
    None (measure).

    Raises:
        ValueError: a value that is neither ``auto`` nor an integer >= 0.
    """
    return _forced(TILES_ENV, 0, "auto, 0 (never) or a number of queries >= 1")


def tiles_key(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, layers: int) -> str:
    """``tiles kernel float32 heads=9 kv=3 dim=64 layers=30`` style key."""
    return f"tiles kernel {str(dtype).removeprefix('torch.')} heads={heads} kv={kv_heads} dim={dim} layers={layers}"


def tile_from_of(buckets, tile_wins) -> int:
    """The smallest bucket from which tiles win at every larger bucket, or 0 (they lose at the
    largest)."""
    start = 0
    for b, win in zip(reversed(list(buckets)), reversed(list(tile_wins))):
        if not win:
            break
        start = int(b)
    return start


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


def _derived(entry: dict, field: str, wins: str, rule, least: int) -> bool:
    """Whether ``entry[field]`` is an integer >= ``least`` that ``rule(buckets, entry[wins])``
    gives, over ascending distinct buckets (a stored entry its own timings do not give is
    measured again)."""
    buckets, w = entry["buckets"], entry[wins]
    return (
        isinstance(entry.get(field), int)
        and entry[field] >= least
        and len(buckets) == len(w) > 0
        and [int(b) for b in buckets] == sorted(set(int(b) for b in buckets))
        and entry[field] == rule(buckets, w)
    )


def _valid(entry: dict) -> bool:
    return _derived(entry, "limit", "kernel", limit_of, 1)


def _timed(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype, layers: int, buckets, reps: int, clock, backends
) -> list[list[float]]:
    """Per bucket q, ms per step (median of ``reps``, after one untimed step each) of a step of
    `DECODES` decodes and one extend of q queries at `CONTEXT` cached keys, attended with each of
    ``backends(q)`` (paged kernels) in turn, interleaved."""
    from ...engine.core.block_allocator import BlockAllocator
    from ...engine.core.kv_pool import KVPool
    from ...engine.runner import SeqInput
    from .batch import pack
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
    spec = AttentionSpec.uniform("measured", layers, dim**-0.5)
    ms = []
    with torch.inference_mode():
        for q in buckets:
            seqs = [SeqInput([0] * q, CONTEXT, tables[0])] + [SeqInput([0], CONTEXT, tb) for tb in tables[1:]]
            n = q + DECODES
            x = torch.randn(n, heads, dim, generator=g, dtype=dtype)
            kv = torch.randn(n, kv_heads, dim, generator=g, dtype=dtype)
            batches = [pack(seqs, pool, spec, "cpu", b)[0] for b in backends(q)]

            def step(fb):
                for layer in range(layers):
                    attend_tokens(fb, layer, x, kv, kv)

            times: list[list[float]] = [[] for _ in batches]
            for fb in batches:
                step(fb)
            for _ in range(reps):  # interleaved: a drift of the machine hits all alike
                for i, fb in enumerate(batches):
                    t0 = clock()
                    step(fb)
                    times[i].append(clock() - t0)
            ms.append([1e3 * statistics.median(t) for t in times])
    pool.release()
    return ms


def measure(
    op,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    layers: int,
    *,
    buckets=BUCKETS,
    reps: int = REPS,
    clock: Callable[[], float] = time.perf_counter,
    tile_from: int | None = None,
) -> dict:
    """Time one step's attention with the extend in the kernel and in the gather backend.

    Args:
        op: the kernel op (`tokenrouter_sdk.backends.cpu_kernels.paged_attention_op`).
        heads, kv_heads, dim: the model's query heads, KV heads and head size.
        dtype: the KV pool's dtype.
        layers: layers attended per step.
        buckets: extend lengths (queries) to time, ascending.
        reps: timed steps per path and bucket, after one untimed step each.
        clock: seconds.
        tile_from: the kernel's tile threshold (`tile_choice`; None: `cpu_kernel.TILE_FROM`).

    Returns:
        ``{"buckets", "kernel" (per bucket: the kernel was faster), "kernel_ms", "gather_ms"
        (medians per step), "limit", "context", "decodes", "layers"}``.
    """
    from .cpu_kernel import TILE_FROM, CpuKernel

    tf = TILE_FROM if tile_from is None else tile_from
    ms = _timed(
        heads,
        kv_heads,
        dim,
        dtype,
        layers,
        buckets,
        reps,
        clock,
        lambda q: [CpuKernel(op, q, tf), CpuKernel(op, q - 1, tf)],
    )
    kernel_ms, gather_ms = [m[0] for m in ms], [m[1] for m in ms]
    wins = [a < b for a, b in zip(kernel_ms, gather_ms)]
    return {
        "buckets": list(buckets),
        "kernel": wins,
        "kernel_ms": [round(v, 4) for v in kernel_ms],
        "gather_ms": [round(v, 4) for v in gather_ms],
        "limit": limit_of(buckets, wins),
        "context": CONTEXT,
        "decodes": DECODES,
        "layers": layers,
    }


def measure_tiles(
    op,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    layers: int,
    *,
    buckets=TILE_BUCKETS,
    reps: int = REPS,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Time one step's attention with the extend's scores tiled (16 keys at a time) and not, the
    extend in the kernel either way (arguments as `measure`).

    Returns:
        ``{"buckets", "tiles" (per bucket: tiles were faster), "tiles_ms", "keys_ms" (medians per
        step), "tile_from", "context", "decodes", "layers"}``.
    """
    from .cpu_kernel import CpuKernel

    ms = _timed(
        heads, kv_heads, dim, dtype, layers, buckets, reps, clock, lambda q: [CpuKernel(op, q, q), CpuKernel(op, q, 0)]
    )
    tiles_ms, keys_ms = [m[0] for m in ms], [m[1] for m in ms]
    wins = [a < b for a, b in zip(tiles_ms, keys_ms)]
    return {
        "buckets": list(buckets),
        "tiles": wins,
        "tiles_ms": [round(v, 4) for v in tiles_ms],
        "keys_ms": [round(v, 4) for v in keys_ms],
        "tile_from": tile_from_of(buckets, wins),
        "context": CONTEXT,
        "decodes": DECODES,
        "layers": layers,
    }


def _valid_tiles(entry: dict) -> bool:
    return _derived(entry, "tile_from", "tiles", tile_from_of, 0)


def tile_choice(
    op,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    layers: int,
    *,
    measure_fn=measure_tiles,
    fields: dict | None = None,
) -> tuple[int, str]:
    """From how many queries the kernel scores a request 16 keys at a time, for a model of these
    shapes: forced by ``TOKENROUTER_KERNEL_TILES``, else this machine's stored choice, else
    measured and stored. Only float32 and bfloat16 pools on a CPU with AVX-512 have tiles (the
    kernel is built for the machine; a bfloat16 tile's key rows are widened to float32 first):
    another dtype or CPU gets 0 unmeasured.

    Returns:
        (queries >= 1, or 0: never; source: ``forced (...)``, ``cached``, ``measured``,
        ``measured (not stored)``, ``no tiles for <dtype>`` or ``no tiles without AVX-512``).

    Raises:
        ValueError: ``TOKENROUTER_KERNEL_TILES`` holds a bad value.
    """
    forced = forced_tiles()
    if forced is not None:
        return forced, f"forced ({TILES_ENV}={forced})"
    if dtype not in (torch.float32, torch.bfloat16):
        return 0, f"no tiles for {str(dtype).removeprefix('torch.')}"
    if "avx512f" not in autotune.cpu_flags():
        return 0, "no tiles without AVX-512"
    entry, source = autotune.choose(
        tiles_key(heads, kv_heads, dim, dtype, layers),
        lambda: measure_fn(op, heads, kv_heads, dim, dtype, layers),
        _valid_tiles,
        fields=fields,
    )
    return int(entry["tile_from"]), source


def extend_limit(
    op,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    layers: int,
    *,
    measure_fn=measure,
    fields: dict | None = None,
    tile_from: int | None = None,
) -> tuple[int, str]:
    """The most queries of one extend the kernel attends for a model of these shapes: forced by
    ``TOKENROUTER_KERNEL_EXTEND``, else this machine's stored choice, else measured and stored.
    ``tile_from``: the kernel's tile threshold (`tile_choice`), measured with and stored apart
    (``tiles=<n>`` in the key); None: `cpu_kernel.TILE_FROM`.

    Returns:
        (limit in queries >= 1, source: ``forced (...)``, ``cached``, ``measured`` or
        ``measured (not stored)``).

    Raises:
        ValueError: ``TOKENROUTER_KERNEL_EXTEND`` holds a bad value.
    """
    forced = forced_limit()
    if forced is not None:
        return forced, f"forced ({ENV}={forced})"
    key = choice_key(heads, kv_heads, dim, dtype, layers)
    if tile_from is None:
        run = lambda: measure_fn(op, heads, kv_heads, dim, dtype, layers)  # noqa: E731
    else:
        key += f" tiles={tile_from}"
        run = lambda: measure_fn(op, heads, kv_heads, dim, dtype, layers, tile_from=tile_from)  # noqa: E731
    entry, source = autotune.choose(key, run, _valid, fields=fields)
    return int(entry["limit"]), source


def describe(key: str, entry: dict) -> str | None:
    """A `tokenrouter info` line for a stored extend or tile choice, or None when ``entry`` is
    neither."""
    if key.startswith("tiles kernel"):
        try:
            if not _valid_tiles(entry):
                return None
            times = ", ".join(
                f"{b}: {a:.2f}/{c:.2f}" for b, a, c in zip(entry["buckets"], entry["tiles_ms"], entry["keys_ms"])
            )
        except (KeyError, TypeError, ValueError):
            return None
        start = f"from {entry['tile_from']} queries" if entry["tile_from"] else "never"
        return (
            f"{key}: the kernel scores 16 keys at a time {start} (ms per step of {entry.get('layers', '?')} "
            f"layers, {entry.get('decodes', '?')} decodes + one extend at {entry.get('context', '?')} keys, "
            f"tiles/a key at a time by queries: {times})"
        )
    try:
        if not key.startswith("extend kernel") or not _valid(entry):
            return None
        times = ", ".join(
            f"{b}: {a:.2f}/{c:.2f}" for b, a, c in zip(entry["buckets"], entry["kernel_ms"], entry["gather_ms"])
        )
    except (KeyError, TypeError, ValueError):
        return None
    return (
        f"{key}: the kernel attends extends of up to {entry['limit']} queries (ms per step of "
        f"{entry.get('layers', '?')} layers, {entry.get('decodes', '?')} decodes + one extend at "
        f"{entry.get('context', '?')} keys, kernel/gather by queries: {times})"
    )
