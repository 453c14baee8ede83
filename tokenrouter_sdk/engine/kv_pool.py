"""A paged KV pool private to one model: fixed-size blocks, a free list, block tables.

Layout: ``k[layer]`` and ``v[layer]`` have shape [num_blocks * block_size, kv_heads, head_dim]
(a flat slot view); slot ``b * block_size + o`` is offset o of block b. A request's block
table is a list of block ids; token position p of the request lives in slot
``table[p // block_size] * block_size + p % block_size``.

Blocks are reference-counted: a block is in the tables of ``refs[b]`` requests. With the prefix
cache on (`KVPool.enable_prefix_cache`), full blocks of committed tokens are indexed by their
content (`tokenrouter_sdk.engine.prefix_cache`), shared read-only by every request whose tokens
start with the same blocks, and kept when no request holds them until their space is needed.
"""

from __future__ import annotations

import math
import mmap

import torch

from .prefix_cache import PrefixCache, chain_keys


class KVPoolFull(RuntimeError):
    """Raised when a request needs more blocks than are free."""


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU backed by an anonymous memory map, whose pages the
    kernel zero-fills on first touch (as calloc does): a pool of hundreds of MB costs nothing
    until its blocks are written, instead of a fill of all of it up front."""
    if torch.device(device).type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, math.prod(shape) * itemsize), dtype=dtype).view(shape)


class KVPool:
    """Paged KV cache of one model.

    Args:
        num_layers, kv_heads, head_dim: from the model config.
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype, device: tensor dtype and device.
        scratch_blocks: extra blocks after the usable ones, never handed out; ``scratch_slot``
            is the first slot of the first one (where CUDA-graph padding rows write their K/V).

    Attributes:
        scratch_slot: a slot no request ever owns, or None without scratch blocks.
        cache: the `PrefixCache`, or None while the prefix cache is off.

    Memory: 2 * num_layers * (num_blocks + scratch_blocks) * block_size * kv_heads * head_dim
    * dtype bytes.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, device="cpu", scratch_blocks: int = 0):
        if num_blocks < 1 or block_size < 1 or scratch_blocks < 0:
            raise ValueError(f"KV pool needs num_blocks >= 1, block_size >= 1 and scratch_blocks >= 0, got "
                             f"{num_blocks}, {block_size}, {scratch_blocks}")
        self.num_blocks, self.block_size, self.scratch_blocks = num_blocks, block_size, scratch_blocks
        self.scratch_slot = num_blocks * block_size if scratch_blocks else None
        shape = (num_layers, (num_blocks + scratch_blocks) * block_size, kv_heads, head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.refs = [0] * num_blocks
        self.cache: PrefixCache | None = None

    def enable_prefix_cache(self) -> None:
        """Index full blocks by content from now on (idempotent)."""
        if self.cache is None:
            self.cache = PrefixCache()

    def clear_prefix_cache(self) -> int:
        """Forget every cached block: the idle ones become free blocks (handed out lowest id
        first, as from a new pool), the ones requests hold stay theirs, unshared. Returns how
        many blocks the cache held."""
        if self.cache is None:
            return 0
        n = len(self.cache)
        self._free.extend(self.cache.clear())
        self._free.sort(reverse=True)
        return n

    @property
    def num_free(self) -> int:
        """Blocks a request can get now: free ones plus cached ones no request holds."""
        return len(self._free) + (self.cache.idle if self.cache is not None else 0)

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache's index (held by requests or idle)."""
        return len(self.cache) if self.cache is not None else 0

    @property
    def idle_cached_blocks(self) -> int:
        """Cached blocks no request holds (evicted first when space is needed; part of num_free)."""
        return self.cache.idle if self.cache is not None else 0

    def _take(self) -> int:
        b = self._free.pop() if self._free else self.cache.evict()
        self.refs[b] = 1
        return b

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def ensure(self, table: list[int], n_tokens: int) -> None:
        """Grow ``table`` in place so it covers ``n_tokens`` positions.

        Raises:
            KVPoolFull: not enough free blocks (the table is left unchanged).
        """
        need = self.blocks_for(n_tokens) - len(table)
        if need <= 0:
            return
        if need > self.num_free:
            raise KVPoolFull(f"need {need} blocks, {self.num_free} free")
        table.extend(self._take() for _ in range(need))

    def free(self, table: list[int]) -> None:
        """Drop ``table``'s reference to each of its blocks and empty it. A block no request holds
        any more is free again, or, if cached, idle in the cache (the table's last blocks first
        in line for eviction: a longer prefix goes before the shorter ones it extends)."""
        self.drop(table, 0)

    def drop(self, table: list[int], keep: int) -> None:
        """Drop the blocks of ``table`` after its first ``keep`` (see `free`), in place."""
        for b in reversed(table[keep:]):
            self.refs[b] -= 1
            if self.refs[b] > 0:
                continue
            if self.cache is not None and self.cache.holds(b):
                self.cache.park(b)
            else:
                self._free.append(b)
        del table[keep:]

    def match(self, tokens, keys: list[bytes], max_blocks: int, start: int = 0) -> list[int]:
        """The longest run of cached blocks that holds ``tokens`` from block ``start`` on (the
        caller holds blocks ``0..start-1`` of the same tokens), up to block ``max_blocks``
        (excluded), each now referenced once more. ``keys`` is the request's list of chain keys
        (extended in place as far as needed)."""
        cache, bs, out = self.cache, self.block_size, []
        if cache is None:
            return out
        for i in range(start, max_blocks):
            chain_keys(tokens, bs, i + 1, keys)
            b = cache.find(keys[i], tokens[i * bs:(i + 1) * bs])
            if b is None:
                break
            if self.refs[b] == 0:
                cache.unpark(b)
            self.refs[b] += 1
            out.append(b)
        return out

    def register(self, table: list[int], tokens, keys: list[bytes], start: int, end: int) -> None:
        """Cache blocks ``start..end-1`` of ``table``, which now hold KV of ``tokens`` (full
        blocks of committed tokens); ``keys`` as in `match`. A block whose content is already
        cached in another block stays private."""
        if self.cache is None:
            return
        bs = self.block_size
        chain_keys(tokens, bs, end, keys)
        for i in range(start, end):
            self.cache.add(keys[i], table[i], tokens[i * bs:(i + 1) * bs])

    def release(self) -> None:
        """Drop the KV tensors (the pool is unusable afterwards); called on close."""
        self.k = self.v = None
        self._free = []
        self.cache = None

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot ids of positions [start, end) of a request, shape [end - start] (int64)."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size
