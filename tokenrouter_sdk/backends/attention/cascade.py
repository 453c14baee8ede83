"""The cascade backend: decode attention in two parts merged by their log-sum-exp (cascade
attention, as FlashInfer and vLLM do for shared prefixes): every query against the keys all
decode requests share (``DecodeView.shared`` columns, prefix-cache blocks their tables share),
read once, then each request against its own keys: a batch of B requests behind one shared
prefix reads the prefix's K/V once per layer instead of B times. Scores are scaled and
soft-capped as the layer's `LayerParams` say; the view's mask applies to the requests' own keys
(the shared columns are never masked: every row reads all of them, which is why a windowed view,
whose rows start at different positions, has none). A step takes it only where it saves at least
`MIN_SAVED` key reads, with one query per request, on a CPU (`pays`); the measurements behind
that threshold are in ``docs/benchmarks.md`` ("Cascade attention (cascade)")."""

from __future__ import annotations

import torch

from .metadata import DecodeView
from .spec import LayerParams

# Shared key reads a decode step must save, (requests - 1) x shared positions, before it attends
# the shared keys once for all: its unfused arithmetic costs more than one padded SDPA call, so
# it pays only when the saved copies are many.
MIN_SAVED = 2048


def pays(dv: DecodeView, nq: int, kc: torch.Tensor) -> bool:
    """Whether a step's decodes of ``dv`` take the cascade (one query per request, on a CPU)."""
    return (dv.kv.shape[0] - 1) * dv.shared >= MIN_SAVED and nq == 1 and kc.device.type == "cpu"


def _softmax_parts(scores: torch.Tensor, values: torch.Tensor):
    """Unnormalised attention over one key range: (max score [.., 1], sum of exp [.., 1],
    exp-weighted values [.., D]). A row whose keys are all masked (-inf) gives zeros."""
    m = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).min)
    p = torch.exp(scores - m)
    return m, p.sum(-1, keepdim=True), torch.matmul(p, values)


def attend(dv: DecodeView, lp: LayerParams, kc: torch.Tensor, vc: torch.Tensor, qd: torch.Tensor) -> torch.Tensor:
    """qd [Bd, H, 1, D] against ``dv``'s keys in one layer's pool kc, vc [slots, Hkv, D]; returns
    [Bd, H, 1, D], equal to `tokenrouter_sdk.backends.attention.gather.attend_decodes` within
    rounding."""
    bd, lmax = dv.kv.shape
    _, h, _, d = qd.shape
    hkv = kc.shape[1]
    g, ls = h // hkv, dv.shared
    scale, cap = lp.scale, lp.softcap
    q = qd.reshape(bd, hkv, g, d)  # query head j*g + i reads KV head j
    shared = dv.kv[0, :ls]
    ks, vs = kc.index_select(0, shared), vc.index_select(0, shared)  # [Ls, Hkv, D]
    qs = q.permute(1, 0, 2, 3).reshape(hkv, bd * g, d)
    s1 = torch.matmul(qs, ks.permute(1, 2, 0)) * scale
    if cap:
        s1 = torch.tanh(s1 / cap) * cap
    m1, l1, o1 = _softmax_parts(s1, vs.transpose(0, 1))
    m1, l1, o1 = (x.view(hkv, bd, g, x.shape[-1]).transpose(0, 1) for x in (m1, l1, o1))  # [Bd, Hkv, g, .]
    lr = lmax - ls
    if lr == 0:
        return (o1 / l1).reshape(bd, h, 1, d)
    rest = dv.kv[:, ls:].reshape(-1)
    kr = kc.index_select(0, rest).view(bd, lr, hkv, d).permute(0, 2, 3, 1)  # [Bd, Hkv, D, Lr]
    vr = vc.index_select(0, rest).view(bd, lr, hkv, d).transpose(1, 2)  # [Bd, Hkv, Lr, D]
    s2 = torch.matmul(q, kr) * scale  # [Bd, Hkv, g, Lr]
    if cap:
        s2 = torch.tanh(s2 / cap) * cap
    if dv.mask is not None:
        s2 = s2.masked_fill(~dv.mask[..., ls:], float("-inf"))
    m2, l2, o2 = _softmax_parts(s2, vr)
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return ((o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)).reshape(bd, h, 1, d)
