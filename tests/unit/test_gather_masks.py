"""The gather backend's masked tiles (extends behind a cached prefix, windowed layers): SDPA gets
each tile's mask folded and additive, made once per step and dtype for every layer, with the bits
of SDPA over the bool mask folded at every call."""

import pytest
import torch

from tokenrouter_sdk.backends.attention import gather
from tokenrouter_sdk.backends.attention.batch import tiles
from tokenrouter_sdk.backends.attention.spec import LayerParams


def _old_segment(qi, kc, vc, k, v, ts, p):
    """A segment attended as before: each masked tile through `attend_masked` with its bool mask."""
    out = qi.new_empty(qi.shape[2], qi.shape[1], qi.shape[3])
    for t in ts:
        qa = qi[:, :, t.q0 : t.q1]
        if t.slots is None:
            ka, va = k[t.k0 : t.k1].transpose(0, 1)[None], v[t.k0 : t.k1].transpose(0, 1)[None]
        else:
            ka, va = kc[t.slots].transpose(0, 1)[None], vc[t.slots].transpose(0, 1)[None]
        out[t.q0 : t.q1] = gather.attend_masked(qa, ka, va, t.mask, p)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("h,hkv", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize(
    "start,n,window,softcap",
    [
        (40, 7, None, None),
        (725, 66, None, None),
        (30, 20, 8, None),
        (0, 50, 12, None),
        (40, 7, None, 2.0),
        (30, 20, 8, 2.0),
    ],
)
def test_masked_tiles_have_the_bits_of_the_bool_masks(dtype, h, hkv, start, n, window, softcap):
    g = torch.Generator().manual_seed(2)
    d, slots_n = 16, 1024
    kc, vc = (torch.randn(slots_n, hkv, d, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(slots_n, generator=g)[: start + n]
    k, v = kc[slots[start:]], vc[slots[start:]]
    qi = torch.randn(1, h, n, d, generator=g).to(dtype)
    p = LayerParams(window, softcap, 0.2)
    ts = tiles(start, n, window, slots, "cpu")
    assert any(t.mask is not None for t in ts)
    want = _old_segment(qi, kc, vc, k, v, ts, p)
    for _ in range(3):  # layers of one step: the same tiles, the mask made once
        assert torch.equal(gather.attend_segment(qi, kc, vc, k, v, ts, p), want)
    for t in ts:
        if t.mask is None or softcap:
            assert t._additive == {}  # the soft-capped path scores with the bool mask
        else:
            assert list(t._additive) == [(dtype, h // hkv)]
            assert t.additive(dtype, h // hkv) is t._additive[(dtype, h // hkv)]
