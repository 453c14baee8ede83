"""The paged attention as a transformers attention implementation (``ATTN_NAME``, registered
with ``AttentionInterface`` and ``AttentionMaskInterface``).

A model switched to it (`use_paged_attention`) calls `paged_attention` in every layer, which:
- in a runner's eager or fixed-shape step (the forward carries ``tr_batch``, the step's
  `ForwardBatch`): writes the new K/V into the pool and attends with the layer's `LayerParams`;
- in a compiled step (``tr_op``): calls the custom op ``tokenrouter::paged_attention``, which reads
  the step's batch itself (`tokenrouter_sdk.backends.compiled_step`);
- when probed (``tr_probe``, `tokenrouter_sdk.backends.attention.spec.probe_layers`): records the
  keywords the layer's attention module passed and stops the module there;
- in ordinary use of the model (``model(...)``, ``model.generate(...)``, the naive reference):
  runs the model's own attention, the implementation it had before the switch (its eager
  attention, with its soft-cap, or SDPA), with the masks transformers builds (causal, sliding
  window, padding). So a model a Router used still computes what it computed before.
A runner's step passes an already prepared 4D ``attention_mask`` (`PagedMask`), so transformers
builds no mask for it.
"""

from __future__ import annotations

import sys

import torch

from .interface import attend_paged
from .spec import _Probed

ATTN_NAME = "tokenrouter_paged"
BASE_ATTR = "_tokenrouter_base_attention"  # on each attention module: its implementation before the switch


def paged_mask(device) -> torch.Tensor:
    """The ``attention_mask`` a runner's step passes: an empty 4D tensor, which transformers' mask
    functions return as it is (an already prepared mask), so no mask is built for a step."""
    return torch.empty(0, 0, 0, 0, dtype=torch.bool, device=device)


def paged_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    tr_batch=None,
    tr_op: bool = False,
    tr_probe: dict | None = None,
    **kwargs,
):
    """Attention over the paged KV pool. query [1, H, T, D], key/value [1, Hkv, T, D]; returns
    ([1, T, H, D], None) as transformers expects (see the module docstring for the cases)."""
    if tr_batch is not None:
        return attend_paged(tr_batch, module.layer_idx, query, key, value), None
    if tr_op:
        return torch.ops.tokenrouter.paged_attention(query, key, value, module.layer_idx), None
    if tr_probe is not None:
        tr_probe.update(kwargs)
        tr_probe.update(
            dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap, _head_dim=query.shape[-1]
        )
        raise _Probed
    return own_attention(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        **kwargs,
    )


def own_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention ``module`` ran before it was switched to the paged one: its model's eager
    attention (with an additive float mask) when that was its implementation, else SDPA
    (flash and flex implementations, which need other devices or mask types, take SDPA too)."""
    base = getattr(module, BASE_ATTR, "sdpa")
    if base == "eager":
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is not None:
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                attention_mask = torch.where(
                    attention_mask,
                    torch.tensor(0.0, dtype=query.dtype, device=query.device),
                    torch.finfo(query.dtype).min,
                )
            return fn(module, query, key, value, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _mask(**kwargs):
    """The mask of an ordinary forward of a switched model: transformers' boolean mask, always
    built (the model's own attention may be the eager one, which needs it even when causal)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(**kwargs)


def register_attention() -> None:
    """Register ``ATTN_NAME`` with transformers (idempotent; called by the runners)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask)


def use_paged_attention(model) -> None:
    """Switch a model (and the configs of modules it shares, e.g. a zero-copy truncation's
    layers) to the paged attention function; each module with a config remembers the
    implementation it had (`own_attention` runs it outside a runner's steps)."""
    register_attention()
    # the implementation of each config object: its own, or (a config a model sharing these modules
    # switched already) the one recorded on a module of the same config
    bases, mods = {}, []
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
        if impl is None:
            continue
        mods.append((mod, cfg))
        if BASE_ATTR in mod.__dict__:
            bases.setdefault(id(cfg), mod.__dict__[BASE_ATTR])
        elif impl != ATTN_NAME:
            bases.setdefault(id(cfg), impl)
    for mod, cfg in mods:
        if BASE_ATTR not in mod.__dict__ and id(cfg) in bases:
            mod.__dict__[BASE_ATTR] = bases[id(cfg)]
    model.set_attn_implementation(ATTN_NAME)
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and cfg._attn_implementation != ATTN_NAME:
            cfg._attn_implementation = ATTN_NAME
