"""The paged KV storage of one model, owned by its runner: K and V tensors in fixed-size blocks.

Layout: ``k[layer]`` and ``v[layer]`` have shape [num_blocks * block_size, kv_heads, head_dim]
(a flat slot view); slot ``b * block_size + o`` is offset o of block b. A request's block
table is a list of block ids; token position p of the request lives in slot
``table[p // block_size] * block_size + p % block_size``.

Which blocks each request holds is not kept here: the sub-server's
`tokenrouter_sdk.engine.core.block_allocator.BlockAllocator` hands out block ids (free list,
reference counts, prefix cache) over the geometry the runner reports (``num_blocks``,
``block_size``).
"""

from __future__ import annotations

import math
import mmap

import torch


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU backed by an anonymous memory map, whose pages the
    kernel zero-fills on first touch (as calloc does): a pool of hundreds of MB costs nothing
    until its blocks are written, instead of a fill of all of it up front."""
    if torch.device(device).type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, math.prod(shape) * itemsize), dtype=dtype).view(shape)


class KVPool:
    """Paged KV storage of one model (its geometry: ``num_blocks``, ``block_size``).

    Args:
        num_layers, kv_heads, head_dim: from the model config.
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype, device: tensor dtype and device.
        scratch_blocks: extra blocks after the usable ones, never handed out; ``scratch_slot``
            is the first slot of the first one (where CUDA-graph padding rows write their K/V).

    Attributes:
        scratch_slot: a slot no request ever owns, or None without scratch blocks.

    Memory: 2 * num_layers * (num_blocks + scratch_blocks) * block_size * kv_heads * head_dim
    * dtype bytes.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        scratch_blocks: int = 0,
    ):
        if num_blocks < 1 or block_size < 1 or scratch_blocks < 0:
            raise ValueError(
                f"KV pool needs num_blocks >= 1, block_size >= 1 and scratch_blocks >= 0, got "
                f"{num_blocks}, {block_size}, {scratch_blocks}"
            )
        self.num_blocks, self.block_size, self.scratch_blocks = num_blocks, block_size, scratch_blocks
        self.scratch_slot = num_blocks * block_size if scratch_blocks else None
        shape = (num_layers, (num_blocks + scratch_blocks) * block_size, kv_heads, head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self._offsets = torch.arange(block_size)  # a slot's place in its block

    @property
    def capacity_tokens(self) -> int:
        """Tokens the usable blocks hold (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

    def release(self) -> None:
        """Drop the KV tensors (the pool is unusable afterwards); called on close."""
        self.k = self.v = None

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot ids of positions [start, end) of a request, shape [end - start] (int64): every
        slot of its blocks in order, cut to the range (one step runs this per request).

        Raises:
            IndexError: ``start`` < 0, ``end`` < ``start``, or ``table``'s blocks do not reach
                position ``end - 1``.
        """
        bs = self.block_size
        if not (0 <= start <= end and (end == start or end <= len(table) * bs)):
            raise IndexError(
                f"positions [{start}, {end}) are not all in the request's {len(table)} blocks of {bs} tokens"
            )
        return (torch.tensor(table, dtype=torch.long).mul_(bs).unsqueeze(1) + self._offsets).view(-1)[start:end]
