"""The prefix cache of one model's KV pool: full KV blocks indexed by what they hold.

A block is cached once every one of its ``block_size`` positions holds KV of committed tokens
(prompt or output: discarded tokens never enter a model's KV). Its key is a chain digest: the
BLAKE2b-256 of the previous block's key and the block's own token ids, so equal keys mean equal
token prefixes from position 0 (as vLLM's automatic prefix caching keys blocks; SGLang's radix
tree is the same index at token granularity). A hit is trusted only when the block's own token ids
also compare equal; a false hit would need two different prefixes with equal 256-bit digests
(probability about n^2 / 2^257 for n cached chains: below 1e-60 for a billion blocks).

Blocks are shared read-only: a request that reuses a chain holds a reference to each block; only
blocks past the longest match are written, and the block a request still writes into is always
its own (a match stops before the block that holds the prompt's last position). Unreferenced
cached blocks stay in the index, least recently used first in line, and are evicted (the
pool's `KVPool.take` reuses them) only when no free block is left: before anything is preempted
or refused.
"""

from __future__ import annotations

import collections
import hashlib
from array import array

ROOT = b""  # the key before a request's first block


def block_key(prev: bytes, tokens) -> bytes:
    """Chain digest of a block holding ``tokens`` after the blocks keyed ``prev`` (32 bytes)."""
    return hashlib.blake2b(prev + array("q", tokens).tobytes(), digest_size=32).digest()


def chain_keys(tokens, block_size: int, n_blocks: int, have: list[bytes] | None = None) -> list[bytes]:
    """Keys of the first ``n_blocks`` full blocks of ``tokens``; ``have`` (keys already known for
    a prefix of them) is extended in place and returned.

    Args:
        tokens: token ids from position 0, at least ``n_blocks * block_size`` of them.
        block_size: tokens per block.
        n_blocks: blocks to key.
        have: keys of the first ``len(have)`` blocks, or None.
    """
    keys = [] if have is None else have
    for i in range(len(keys), n_blocks):
        keys.append(block_key(keys[-1] if keys else ROOT, tokens[i * block_size : (i + 1) * block_size]))
    return keys


class PrefixCache:
    """Index of cached blocks by chain key, and the least-recently-used order of the
    unreferenced ones (the pool keeps the reference counts)."""

    def __init__(self):
        self._by_key: dict[bytes, int] = {}
        self._meta: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (key, its token ids)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced, LRU first

    def __len__(self) -> int:
        return len(self._meta)

    @property
    def idle(self) -> int:
        """Cached blocks no request holds (evictable; they count as free)."""
        return len(self._idle)

    def holds(self, block: int) -> bool:
        return block in self._meta

    def find(self, key: bytes, tokens) -> int | None:
        """The cached block with ``key`` whose token ids equal ``tokens``, or None."""
        b = self._by_key.get(key)
        if b is None or self._meta[b][1] != tuple(tokens):
            return None
        return b

    def add(self, key: bytes, block: int, tokens) -> bool:
        """Index ``block`` (referenced, full, holding ``tokens``) under ``key``; False when the key
        is already cached in another block (this one then stays private) or the block is cached."""
        if key in self._by_key or block in self._meta:
            return False
        self._by_key[key] = block
        self._meta[block] = (key, tuple(tokens))
        return True

    def forget(self, block: int) -> None:
        """Drop ``block`` from the index (its content is about to change or it is evicted)."""
        key, _ = self._meta.pop(block)
        del self._by_key[key]
        self._idle.pop(block, None)

    def park(self, block: int) -> None:
        """``block`` lost its last reference: most recently used of the idle ones."""
        self._idle[block] = None

    def unpark(self, block: int) -> None:
        """``block`` is referenced again."""
        self._idle.pop(block, None)

    def evict(self) -> int | None:
        """The least recently used idle block, dropped from the index (None if none is idle)."""
        if not self._idle:
            return None
        block = next(iter(self._idle))
        self.forget(block)
        return block

    def clear(self) -> list[int]:
        """Forget every cached block; returns the idle ones (now plain free blocks)."""
        idle = list(self._idle)
        self._by_key.clear()
        self._meta.clear()
        self._idle.clear()
        return idle
