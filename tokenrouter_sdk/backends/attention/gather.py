"""The gather backend: a request's keys copied out of the pool (``index_select``) and attended
with torch's SDPA, or with explicit scores where SDPA cannot compute the layer (a soft-capped
layer: SDPA has no logit soft-cap). Serves the decodes the CPU kernel does not take (kernels off,
another device, other dtypes), every prefill and long extend, and fixed-shape (CUDA-graph) steps.

With grouped-query attention (H = g * Hkv) the g query heads of each KV head are folded into the
query dimension ([B, Hkv, g*Q, D]; query head j*g + i uses KV head j, as transformers'
``repeat_kv``), so K/V are never repeated, and SDPA's fused kernels take the mask: with
``enable_gqa`` and a mask, CUDA falls back to the math kernel, which materialises the scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import DecodeView, Tile
from .spec import LayerParams

# query rows per block of the explicit-scores path (bounds its [rows, keys] score matrix)
SCORE_ROWS = 256


def sdpa(q, k, v, mask, is_causal: bool, scale: float):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _fold(mask: torch.Tensor, g: int) -> torch.Tensor:
    """A [.., Q, L] mask for queries folded g times into the query dimension."""
    if g == 1 or mask.shape[-2] == 1:
        return mask
    return mask.repeat(*([1] * (mask.dim() - 2)), g, 1)


def scores_attend(q, k, v, mask, p: LayerParams, causal: bool = False) -> torch.Tensor:
    """Attention with the scores written out, as transformers' eager attention computes them:
    ``s = q k^T * scale``, soft-capped (``softcap * tanh(s / softcap)``), masked, softmax (in
    float32 for 16-bit inputs), times v. q [B, H, Q, D], k/v [B, Hkv, L, D]; mask broadcastable
    to [B, 1, Q, L] (True = attend) or None; ``causal``: queries and keys aligned (Q = L), query
    i sees keys j <= i. Returns [B, H, Q, D]; queries are taken ``SCORE_ROWS`` at a time."""
    b, h, nq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    soft = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    out = q.new_empty(b, h, nq, d)
    for a in range(0, nq, SCORE_ROWS):
        e = min(nq, a + SCORE_ROWS)
        n = e - a
        keys = e if causal else k.shape[2]
        qa = q[:, :, a:e].reshape(b, hkv, g * n, d)
        s = torch.matmul(qa, k[:, :, :keys].transpose(-1, -2)) * p.scale  # [B, Hkv, g*n, keys]
        if p.softcap:
            s = torch.tanh(s / p.softcap) * p.softcap
        if causal:
            m = torch.arange(keys, device=q.device)[None, :] <= torch.arange(a, e, device=q.device)[:, None]
            s = s.masked_fill(~_fold(m, g), float("-inf"))
        elif mask is not None:
            m = mask[..., a:e, :] if mask.shape[-2] > 1 else mask
            s = s.masked_fill(~_fold(m, g), float("-inf"))
        w = torch.softmax(s, -1, dtype=soft).to(q.dtype)
        out[:, :, a:e] = torch.matmul(w, v[:, :, :keys]).view(b, h, n, d)
    return out


def attend_masked(q, k, v, mask, p: LayerParams) -> torch.Tensor:
    """Attention with an explicit key mask (or none), not causal. q [B, H, Q, D], k/v [B, Hkv, L, D],
    mask broadcastable to [B, 1, Q, L] (bool, True = attend) or None; returns [B, H, Q, D]."""
    if p.softcap:
        return scores_attend(q, k, v, mask, p)
    b, h, nq, d = q.shape
    g = h // k.shape[1]
    if g == 1:
        return sdpa(q, k, v, mask, False, p.scale)
    q = q.reshape(b, k.shape[1], g * nq, d)
    if mask is not None and nq > 1:
        mask = _fold(mask, g)
    return sdpa(q, k, v, mask, False, p.scale).reshape(b, h, nq, d)


def attend_folded(q, k, v, mask: torch.Tensor, p: LayerParams) -> torch.Tensor:
    """`attend_masked` with its mask already folded and additive (`Tile.additive`), no soft-cap:
    q [B, H, Q, D], k/v [B, Hkv, L, D], mask [g * Q, L] of q's dtype (g = H / Hkv); returns
    [B, H, Q, D], the bits of `attend_masked` with the bool mask (SDPA makes the same additive
    mask of it), without folding and converting the mask again in every layer (a quarter of a
    bfloat16 extend's attention at 66 queries and 791 keys, 30 layers, 2-core Intel Xeon)."""
    b, h, nq, d = q.shape
    hkv = k.shape[1]
    return sdpa(q.reshape(b, hkv, (h // hkv) * nq, d), k, v, mask, False, p.scale).reshape(b, h, nq, d)


def attend_decodes(
    dv: DecodeView, p: LayerParams, kc: torch.Tensor, vc: torch.Tensor, qd: torch.Tensor
) -> torch.Tensor:
    """Decode queries qd [Bd, H, Q, D] against each request's keys of ``dv`` (one layer's pool
    kc, vc [slots, Hkv, D]); returns [Bd, H, Q, D]."""
    bd, lmax = dv.kv.shape
    flat = dv.kv.view(-1)
    kd = kc.index_select(0, flat).view(bd, lmax, *kc.shape[1:]).transpose(1, 2)  # [Bd, Hkv, L, D]
    vd = vc.index_select(0, flat).view(bd, lmax, *vc.shape[1:]).transpose(1, 2)
    return attend_masked(qd, kd, vd, dv.mask, p)


def _tile(qi, kc, vc, k, v, t: Tile, p: LayerParams) -> torch.Tensor:
    qa = qi[:, :, t.q0 : t.q1]
    if t.slots is None:
        ka = k[t.k0 : t.k1].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        va = v[t.k0 : t.k1].transpose(0, 1).unsqueeze(0)
    else:
        ka = kc.index_select(0, t.slots).transpose(0, 1).unsqueeze(0)
        va = vc.index_select(0, t.slots).transpose(0, 1).unsqueeze(0)
    if t.mask is not None:
        if p.softcap:
            return scores_attend(qa, ka, va, t.mask, p)
        return attend_folded(qa, ka, va, t.additive(qa.dtype, qa.shape[1] // ka.shape[1]), p)
    if p.softcap:
        return scores_attend(qa, ka, va, None, p, causal=True)
    return sdpa(qa, ka, va, None, t.q1 - t.q0 > 1, p.scale)


def attend_segment(qi, kc, vc, k, v, tiles: tuple[Tile, ...], p: LayerParams) -> torch.Tensor:
    """One prefill or extend: qi [1, H, ql, D] its queries, k/v [ql, Hkv, D] the K/V it wrote this
    step (a tile without slots attends those rows, with no gather), ``tiles`` what its query rows
    read in this layer's window; returns [ql, H, D]."""
    if len(tiles) == 1:
        return _tile(qi, kc, vc, k, v, tiles[0], p)[0].transpose(0, 1)
    out = qi.new_empty(qi.shape[2], qi.shape[1], qi.shape[3])
    for t in tiles:
        out[t.q0 : t.q1] = _tile(qi, kc, vc, k, v, t, p)[0].transpose(0, 1)
    return out
