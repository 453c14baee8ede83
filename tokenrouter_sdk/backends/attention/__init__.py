"""Paged attention: one interface, one file per backend.

- `spec`: each layer's parameters (window, soft-cap, scale) and the model's final-logit soft-cap,
  read once from the model itself; unsupported features refused at load time.
- `metadata`: a step's `ForwardBatch` (built once per step by `batch.pack`, or by a fixed-shape
  step); `interface`: `attend_tokens`, the one call every forward makes per layer.
- backends: `gather` (gather + SDPA, or explicit scores for soft-capped layers), `cpu_kernel`
  (the in-place C++ kernel, a `PagedKernel`), `cascade` (shared-prefix decodes). A GPU paged
  kernel is one more file with a `PagedKernel` class, which the runner hands to `batch.pack`.
- `hf`: the transformers attention implementation that routes a model's layers here.
"""

from .batch import PadSeq, pack
from .hf import ATTN_NAME, paged_mask, register_attention, use_paged_attention
from .interface import attend_paged, attend_tokens
from .metadata import DecodeView, ForwardBatch, KernelPart, PagedKernel, Tile
from .spec import AttentionSpec, LayerParams, UnsupportedAttention, read_spec

__all__ = [
    "ATTN_NAME",
    "AttentionSpec",
    "DecodeView",
    "ForwardBatch",
    "KernelPart",
    "LayerParams",
    "PadSeq",
    "PagedKernel",
    "Tile",
    "UnsupportedAttention",
    "attend_paged",
    "attend_tokens",
    "pack",
    "paged_mask",
    "read_spec",
    "register_attention",
    "use_paged_attention",
]
