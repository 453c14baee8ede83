"""Which KV blocks of one model each request holds: the free list, reference counts and the
prefix cache, over block ids only. It owns no KV tensors: the runner owns its storage
(`tokenrouter_sdk.engine.core.kv_pool.KVPool` for the torch runners) and reports its geometry (blocks,
block size); the sub-server's scheduler allocates block ids here and passes block tables to the
runner's ``forward``. Block ids are the only KV contract between the two.

A request's block table is a list of block ids; token position p of the request lives at offset
``p % block_size`` of block ``table[p // block_size]``.

Blocks are reference-counted: a block is in the tables of ``refs[b]`` requests. With the prefix
cache on (`BlockAllocator.enable_prefix_cache`), full blocks of committed tokens are indexed by
their content (`tokenrouter_sdk.engine.core.prefix_cache`), shared read-only by every request whose
tokens start with the same blocks, and kept when no request holds them until their space is
needed.
"""

from __future__ import annotations

from .prefix_cache import PrefixCache, chain_keys


class KVPoolFull(RuntimeError):
    """Raised when a request needs more blocks than are free."""


class BlockAllocator:
    """Block ids of one model's KV storage, handed out to requests' block tables.

    Args:
        num_blocks: usable blocks of the storage (ids ``0..num_blocks-1``).
        block_size: tokens per block.

    Attributes:
        refs: per block, how many tables hold it.
        cache: the `PrefixCache`, or None while the prefix cache is off.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a block allocator needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.refs = [0] * self.num_blocks
        self.cache: PrefixCache | None = None

    @classmethod
    def over(cls, geometry) -> "BlockAllocator":
        """A fresh allocator of the blocks a runner's KV geometry has (anything with
        ``num_blocks`` and ``block_size``: a `KVPool`, a `tokenrouter_sdk.engine.runner.PoolShape`)."""
        return cls(geometry.num_blocks, geometry.block_size)

    def enable_prefix_cache(self) -> None:
        """Index full blocks by content from now on (idempotent)."""
        if self.cache is None:
            self.cache = PrefixCache()

    def clear_prefix_cache(self) -> int:
        """Forget every cached block: the idle ones become free blocks (handed out lowest id
        first, as from a new allocator), the ones requests hold stay theirs, unshared. Returns
        how many blocks the cache held."""
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

    @property
    def capacity_tokens(self) -> int:
        """Tokens the blocks hold in all (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that ``n_tokens`` positions need."""
        return -(-n_tokens // self.block_size)

    def _take(self) -> int:
        b = self._free.pop() if self._free else self.cache.evict()
        self.refs[b] = 1
        return b

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
            b = cache.find(keys[i], tokens[i * bs : (i + 1) * bs])
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
            self.cache.add(keys[i], table[i], tokens[i * bs : (i + 1) * bs])


def blocks_of(runner) -> BlockAllocator:
    """The `BlockAllocator` of ``runner``'s KV storage in this process: made at the first call
    (over ``runner.pool``'s geometry) and kept on the runner (``runner.kv_blocks``), so every
    sub-server over one runner object (a runner given to two Routers, a notebook cell re-run
    before the old Router closed) allocates from one free list and two requests never get one
    block. A runner whose storage was replaced (another geometry) gets a fresh one."""
    pool = runner.pool
    blocks = getattr(runner, "kv_blocks", None)
    if not isinstance(blocks, BlockAllocator) or (blocks.num_blocks, blocks.block_size) != (
        pool.num_blocks,
        pool.block_size,
    ):
        blocks = BlockAllocator.over(pool)
        runner.kv_blocks = blocks
    return blocks
