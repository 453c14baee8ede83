"""Packing a step: the requests' fed tokens into one [1, T] sequence, and the step's
`ForwardBatch` (which request each backend attends, and what it reads in each window)."""

from __future__ import annotations

import torch

from .metadata import DecodeView, ForwardBatch, PagedKernel, Tile
from .spec import AttentionSpec

# query rows of one tile of a windowed prefill or extend: a tile reads the keys of its rows'
# windows only, at most rows + window - 1 of them
TILE_ROWS = 256


class PadSeq:
    """A request of its own ``tokens`` at positions 0.. whose K/V live in the given scratch
    ``slots`` (compiled steps' padding and warm-up)."""

    all_hidden = False

    def __init__(self, slots: list[int], tokens: list[int] | None = None):
        self.tokens, self.start, self.table = tokens or [0] * len(slots), 0, []
        self.slots = torch.tensor(slots)


def tiles(start: int, n: int, window: int | None, slots: torch.Tensor, dev) -> tuple[Tile, ...]:
    """What the queries of a request fed ``n`` tokens from position ``start`` read in layers of
    ``window``; ``slots``: the pool slots of its positions 0 .. start + n - 1."""
    end = start + n
    if start == 0 and (window is None or window >= n):  # causal over the step's own rows
        return (Tile(0, n, None, 0, n, None),)
    if window is None:  # extend: query i sees keys j <= start + i
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        return (Tile(0, n, slots.to(dev), 0, end, mask.to(dev)),)
    rows = max(TILE_ROWS, window)
    out = []
    for a in range(0, n, rows):
        b = min(n, a + rows)
        qa, qb = start + a, start + b  # query positions
        ka = max(0, qa - window + 1)  # first key any of them sees
        kp, qp = torch.arange(ka, qb)[None, :], torch.arange(qa, qb)[:, None]
        mask = ((kp <= qp) & (kp > qp - window)).to(dev)
        if start == 0:  # keys are the step's own rows
            out.append(Tile(a, b, None, ka, qb, mask))
        else:
            out.append(Tile(a, b, slots[ka:qb].to(dev), 0, 0, mask))
    return tuple(out)


def _decode_views(spec: AttentionSpec, dec_kv: list, dec_len: list[int], shared: int, dev) -> tuple[DecodeView, ...]:
    views = []
    for w in spec.windows:
        if w is None:
            rows, lens = dec_kv, dec_len
        else:
            lens = [min(n, w) for n in dec_len]
            rows = [sl[n - m :] for sl, n, m in zip(dec_kv, dec_len, lens)]
        lmax = max(lens)
        kv = torch.zeros(len(rows), lmax, dtype=torch.long)
        for i, sl in enumerate(rows):
            kv[i, : len(sl)] = sl
        mask = None
        if min(lens) != lmax:
            mask = (torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :].to(dev)
        views.append(DecodeView(kv.to(dev), mask, shared if w is None else 0))
    return tuple(views)


def pack(
    seqs: list, pool, spec: AttentionSpec, device, kernel: PagedKernel | None = None
) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's `ForwardBatch`, token ids [1, T], positions [1, T] and each request's last
    packed index [B].

    Args:
        seqs: `SeqInput`s (or `PadSeq`s), block tables already grown to cover their tokens.
        pool: the model's `KVPool`.
        spec: the model's `AttentionSpec` (its windows decide the views built).
        device: where the step runs.
        kernel: a `PagedKernel` (e.g. `cpu_kernel.CpuKernel`): every decode and extend of at
            most its ``max_queries`` tokens goes to it; None sends decodes to the gather backend.
    """
    dev = device
    ids, pos, slots, last = [], [], [], []
    dec_q, dec_kv, dec_len, dec_tables, segs = [], [], [], [], []
    kern = []  # (q_start, q_len, kv_len, slots) of the requests the kernel attends
    windows = spec.windows
    t = 0
    for s in seqs:
        n, end = len(s.tokens), s.start + len(s.tokens)
        ids.extend(s.tokens)
        pos.extend(range(s.start, end))
        all_slots = s.slots if isinstance(s, PadSeq) else pool.slots(s.table, 0, end)
        slots.append(all_slots[s.start :])
        if kernel is not None and (n == 1 or (s.start > 0 and n <= kernel.max_queries)):
            kern.append((t, n, end, all_slots))
        elif n == 1:
            dec_q.append(t)
            dec_kv.append(all_slots)
            dec_len.append(end)
            dec_tables.append(s.table)
        else:
            segs.append((t, n, tuple(tiles(s.start, n, w, all_slots, dev) for w in windows)))
        t += n
        last.append(t - 1)
    shared = 0
    if len(dec_tables) > 1:  # leading blocks every decode request's table shares (its last is its own)
        first, lim = dec_tables[0], min(map(len, dec_tables)) - 1
        while shared < lim and all(tb[shared] == first[shared] for tb in dec_tables[1:]):
            shared += 1
    dq = dec = None
    if dec_q:
        dec = _decode_views(spec, dec_kv, dec_len, shared * pool.block_size, dev)
        dq = torch.tensor(dec_q, device=dev)
    fb = ForwardBatch(
        pool,
        torch.cat(slots).to(dev),
        spec.layers,
        spec.view,
        dq,
        dec,
        segs=segs,
        kern=kernel.part(kern) if kern else None,
    )
    return (fb, torch.tensor([ids], device=dev), torch.tensor([pos], device=dev), torch.tensor(last, device=dev))
