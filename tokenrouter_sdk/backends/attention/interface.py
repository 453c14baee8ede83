"""The attention interface: a step's metadata (`ForwardBatch`) and the one entry point every
forward calls per layer (`attend_tokens`), which writes the layer's new K/V into the pool and
sends each part of the batch to its backend with the layer's `LayerParams`.

A step's requests are split, once per step (`tokenrouter_sdk.backends.attention.batch`), into:
- ``kern``: decodes and short extends a paged kernel attends in place (`metadata.PagedKernel`:
  `cpu_kernel.CpuKernel`);
- ``dec``: the other decodes, attended together over a padded gather of their keys (`gather`),
  or in two parts when they share leading KV blocks (`cascade`);
- ``segs``: prefills and long extends, one by one (`gather`).
What a request reads depends on the layer's window, so the decode tables and the segments' key
ranges are built once per distinct window of the model (`DecodeView`, `Tile`) and each layer
picks its window's (``view``). A backend computes every `LayerParams` field exactly (window,
soft-cap, scale); a GPU paged kernel is one more backend file with a `PagedKernel` class, which
the runner passes to `batch.pack` as it passes `cpu_kernel.CpuKernel`.
"""

from __future__ import annotations

import torch

from . import cascade, gather
from .metadata import ForwardBatch


def attend_tokens(
    fb: ForwardBatch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stored: bool = False
) -> torch.Tensor:
    """Write the step's new K/V of ``layer`` into the pool slots of ``fb`` (unless ``stored``:
    the caller wrote them) and attend every request to its cached prefix with the layer's
    parameters. q [T, H, D], k/v [T, Hkv, D] (any strides); returns a new [T, H, D] tensor."""
    kc, vc = fb.pool.k[layer], fb.pool.v[layer]
    if not stored and fb.kern is not None:
        fb.kern.backend.store(kc, vc, fb.slot_mapping, k, v)
    elif not stored:
        kc.index_copy_(0, fb.slot_mapping, k)
        vc.index_copy_(0, fb.slot_mapping, v)
    p, w = fb.layers[layer], fb.view[layer]
    t, h, d = q.shape
    if fb.kern is not None:
        q = q.contiguous()
        out = q.new_empty(t, h, d)
        fb.kern.backend.attend(fb.kern, p, out, q, kc, vc)
        qt = q.transpose(0, 1)
    else:
        only_decodes = not fb.segs and fb.dec_qlen == 1 and fb.dec_q is not None and fb.dec_q.shape[0] == t
        qt = q.transpose(0, 1)  # [H, T, D]
        out = None if only_decodes else q.new_empty(t, h, d)  # [T, H, D]
        if fb.dec_q is not None:
            dv = fb.dec[w]
            bd = dv.kv.shape[0]
            nq = fb.dec_qlen
            # decode token i is packed token fb.dec_q[i]; in a step of decodes only, token i itself
            qd = qt.unsqueeze(2).transpose(0, 1) if only_decodes else qt[:, fb.dec_q].view(h, bd, nq, d).transpose(0, 1)
            if cascade.pays(dv, nq, kc):
                od = cascade.attend(dv, p, kc, vc, qd)  # [Bd, H, Q, D]
            else:
                od = gather.attend_decodes(dv, p, kc, vc, qd)
            if only_decodes:
                return od.transpose(1, 2).reshape(t, h, d)
            out[fb.dec_q] = od.transpose(1, 2).reshape(bd * nq, h, d)
    for qs, ql, views in fb.segs:
        out[qs : qs + ql] = gather.attend_segment(
            qt[:, qs : qs + ql].unsqueeze(0), kc, vc, k[qs : qs + ql], v[qs : qs + ql], views[w], p
        )
    return out


def attend_paged(fb: ForwardBatch, layer: int, query, key, value) -> torch.Tensor:
    """`attend_tokens` in transformers' layout: query [1, H, T, D], key/value [1, Hkv, T, D];
    returns [1, T, H, D]."""
    return attend_tokens(
        fb, layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    ).unsqueeze(0)
