"""A step's attention metadata (see `tokenrouter_sdk.backends.attention.interface`): built once
per step by `tokenrouter_sdk.backends.attention.batch.pack` (or a fixed-shape step), read by every
layer's attention."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .spec import LayerParams


@dataclass
class DecodeView:
    """What the gathered decode requests read in the layers of one window.

    Attributes:
        kv: pool slots of each request's keys, left-aligned and padded, [Bd, L] (a windowed view
            holds only the keys inside the window: the last ``window`` positions).
        mask: [Bd, 1, Q, L] bool (True = attend), or None when every row reads all its L keys.
        shared: leading key columns every row reads from the same pool slots (prefix-cache
            blocks their tables share), a multiple of the block size; 0 in windowed views.
    """

    kv: torch.Tensor
    mask: torch.Tensor | None
    shared: int = 0


@dataclass
class Tile:
    """A block of one segment's queries against one range of keys.

    Attributes:
        q0, q1: query rows of the segment (relative to its first packed row).
        slots: pool slots of the keys [L], or None: the step's own K/V rows ``k0 .. k1 - 1`` of the
            segment (a prefill from position 0 attends what it just wrote, without a gather).
        k0, k1: the key rows, when ``slots`` is None.
        mask: [q1 - q0, L] bool (True = attend), or None: causal, queries and keys aligned.
    """

    q0: int
    q1: int
    slots: torch.Tensor | None
    k0: int
    k1: int
    mask: torch.Tensor | None
    _additive: dict = field(default_factory=dict, repr=False, compare=False)

    def additive(self, dtype: torch.dtype, g: int) -> torch.Tensor:
        """``mask`` as SDPA's additive mask for queries folded ``g`` times into the query
        dimension (query head j*g + i of KV head j): [g * (q1 - q0), L] of ``dtype``, 0 where a
        query attends and -inf elsewhere, what SDPA makes of a bool mask at every call. Made once
        per dtype and fold and kept: every layer of the step's attention reads it."""
        key = (dtype, g)
        if key not in self._additive:
            m = self.mask if g == 1 else self.mask.repeat(g, 1)
            self._additive[key] = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
        return self._additive[key]


@dataclass
class KernelPart:
    """The requests a paged kernel attends in place (their tokens are in neither ``dec`` nor
    ``segs``): the kernel (`PagedKernel`), the pool slots of every key position [R, Lmax], and
    per request its first packed row, queries and keys [R] (int64). Shared by every window: the
    kernel reads only the keys inside the layer's window."""

    backend: PagedKernel
    table: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    kv_len: torch.Tensor


class PagedKernel(Protocol):
    """An attention backend that attends decodes and extends of at most ``max_queries`` tokens
    in place in the KV pool (`tokenrouter_sdk.backends.attention.cpu_kernel.CpuKernel`; a GPU
    paged kernel is one more file with this class). A runner passes one to `batch.pack`; every
    layer's `interface.attend_tokens` calls its ``store`` with the step's new K/V, then its
    ``attend``.

    Attributes:
        max_queries: the longest extend (tokens) it attends; longer ones go to the gather
            backend.
    """

    max_queries: int

    def part(self, rows: list) -> KernelPart:
        """The step's `KernelPart` of (q_start, q_len, kv_len, slots [kv_len]) per request."""

    def attend(
        self, part: KernelPart, p: LayerParams, out: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
    ) -> None:
        """Write the rows of ``out`` [T, H, D] that ``part``'s requests own: their queries of
        ``q`` [T, H, D] (contiguous) against their keys in one layer's pool kc, vc
        [slots, Hkv, D], with ``p``'s window, soft-cap and scale."""

    def store(self, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new keys and values into one layer's pool: ``kc[slots[t]] = k[t]``
        and ``vc[slots[t]] = v[t]``; k, v [T, Hkv, D] (unit stride in D), slots [T] int64, the
        pool slot of every fed token (all of the step's requests, not only ``part``'s)."""


@dataclass
class ForwardBatch:
    """Per-step attention metadata shared by all layers (built once per step).

    Attributes:
        pool: the model's KV pool.
        slot_mapping: pool slot of every fed token, shape [T].
        layers: per layer its `LayerParams` (the runner's `AttentionSpec.layers`).
        view: per layer the index of its window's entry in ``dec`` and in each segment's views.
        dec_q: packed indices of the gathered decode tokens, [Bd * Q] request-major, or None.
        dec: per window a `DecodeView` (None without gathered decodes).
        dec_qlen: queries per gathered decode request, Q (1 in eager steps; a fixed-shape step,
            `tokenrouter_sdk.backends.cuda_graphs`, feeds every request Q padded tokens).
        segs: prefills and long extends as (q_start, q_len, per window a tuple of `Tile`).
        kern: the `KernelPart`, or None.
    """

    pool: object
    slot_mapping: torch.Tensor
    layers: tuple[LayerParams, ...]
    view: tuple[int, ...]
    dec_q: torch.Tensor | None = None
    dec: tuple[DecodeView, ...] | None = None
    dec_qlen: int = 1
    segs: list = field(default_factory=list)
    kern: KernelPart | None = None
