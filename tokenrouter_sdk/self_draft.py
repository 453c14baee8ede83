"""Self-draft small models: the first ``k`` layers of a large model (shared, zero-copy) topped by a
few trained decoder layers and a trained final norm, distilled from the large model's
next-token distributions.

Design: an early-exit draft in the spirit of LayerSkip (arXiv 2404.16710, section 3) and Kangaroo
(arXiv 2404.18911, section 3.1: a shallow sub-network of the target model plus a small trained
adapter, the LM head shared). Here the adapter is ``m`` full decoder layers initialised as copies of
the large model's *last* ``m`` layers (which already map a residual stream to the output space),
plus a copy of its final norm; the embedding, the first ``k`` layers, the rotary embedding and the
tied LM head stay shared with the large model (no new memory for them). The result is an ordinary
``transformers`` causal LM with ``k + m`` layers, so every backend (paged KV, packed batches) runs
it unchanged.

Files: the trained part is one safetensors file (bf16, about 7 MB per layer for SmolLM2-135M) with a
JSON sidecar (``<name>.json``) recording how it was made: base model, ``k``, ``m``, data, metrics.
The packaged pair's draft ships inside the package (``tokenrouter_sdk/assets/``); it is rebuilt
from scratch by ``tokenrouter distill`` (see `tokenrouter_sdk.train.self_draft`). This module is the
run-time side: the file format and attaching a draft to its large model (`load_self_draft`, used by
`tokenrouter_sdk.models.default_pair`); it needs no training code.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_DRAFT = ASSETS / "smollm2_self_draft.safetensors"


class DraftMismatchError(ValueError):
    """A self-draft file does not fit the large model it is attached to."""


def attach_layers(large, k: int, extra: list[nn.Module], norm: nn.Module):
    """Assemble a ``k + len(extra)``-layer causal LM: ``large``'s embedding, first ``k`` layers,
    rotary embedding and LM head (all shared, zero-copy), then ``extra`` decoder layers and ``norm``.

    Each extra layer's attention gets ``layer_idx = k + j`` so that KV caches index it correctly.
    Raises ``ValueError`` unless ``1 <= k < large.config.num_hidden_layers``.
    """
    n = large.config.num_hidden_layers
    if not isinstance(k, int) or not 1 <= k < n:
        raise ValueError(f"self-draft: k (shared layers) must be an int with 1 <= k < {n}, got {k!r}")
    cfg = copy.deepcopy(large.config)
    cfg.num_hidden_layers = k + len(extra)
    if getattr(cfg, "layer_types", None) is not None:
        types = list(large.config.layer_types)
        cfg.layer_types = types[:k] + types[n - len(extra) :]
    with torch.device("meta"):
        small = type(large)(cfg)
    full = large.model
    for j, layer in enumerate(extra):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn.layer_idx = k + j
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = k + j
    small.model.embed_tokens = full.embed_tokens
    small.model.layers = nn.ModuleList(list(full.layers[:k]) + list(extra))
    small.model.norm = norm
    small.model.rotary_emb = full.rotary_emb
    small.lm_head = large.lm_head
    small.config._attn_implementation = large.config._attn_implementation
    small.config.dtype = large.dtype
    small.generation_config = copy.deepcopy(large.generation_config)
    return small.eval()


def init_trainable(large, m: int) -> tuple[list[nn.Module], nn.Module]:
    """Fresh trainable parts: deep copies of ``large``'s last ``m`` decoder layers and its final
    norm (float32, ``requires_grad=True``). Raises ``ValueError`` unless ``1 <= m <= layers``."""
    n = large.config.num_hidden_layers
    if not isinstance(m, int) or not 1 <= m <= n:
        raise ValueError(f"self-draft: m (trained layers) must be an int with 1 <= m <= {n}, got {m!r}")
    extra = [copy.deepcopy(layer).float().requires_grad_(True) for layer in large.model.layers[n - m :]]
    norm = copy.deepcopy(large.model.norm).float().requires_grad_(True)
    return extra, norm


def trainable_state(extra: list[nn.Module], norm: nn.Module, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Flat state dict of the trained part: ``layers.{j}.<param>`` and ``norm.<param>``."""
    sd = {f"norm.{k}": v for k, v in norm.state_dict().items()}
    for j, layer in enumerate(extra):
        sd.update({f"layers.{j}.{k}": v for k, v in layer.state_dict().items()})
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in sd.items()}


def save_self_draft(path, extra: list[nn.Module], norm: nn.Module, meta: dict, dtype=torch.bfloat16) -> Path:
    """Write the trained part to ``path`` (safetensors) and ``meta`` (must hold ``k``, ``m`` and
    ``base``) to the JSON sidecar ``path.with_suffix('.json')``. Returns ``path``."""
    from safetensors.torch import save_file

    for key in ("k", "m", "base"):
        if key not in meta:
            raise ValueError(f"save_self_draft: meta needs {key!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        trainable_state(extra, norm, dtype),
        str(path),
        metadata={"k": str(meta["k"]), "m": str(meta["m"]), "base": str(meta["base"])},
    )
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
    return path


def read_meta(path=DEFAULT_DRAFT) -> dict:
    """The JSON sidecar of a self-draft file (how it was made and what it measured)."""
    side = Path(path).with_suffix(".json")
    if not side.is_file():
        raise FileNotFoundError(f"self-draft metadata {str(side)!r} is missing (it is written next to the weights)")
    return json.loads(side.read_text())


def load_self_draft(large, path=DEFAULT_DRAFT):
    """Build the self-draft small model of ``large`` from a trained-part file.

    Args:
        large: the large ``*ForCausalLM`` (its dtype and device are used for the trained part).
        path: a file written by `save_self_draft` (default: the packaged SmolLM2-135M draft).

    Returns:
        a causal LM with ``k + m`` layers sharing ``large``'s embedding, first ``k`` layers and LM head.

    Raises:
        FileNotFoundError: ``path`` does not exist (rebuild it with ``tokenrouter distill``).
        DraftMismatchError: the file's shapes or ``base`` do not fit ``large``.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"self-draft file {str(path)!r} does not exist; rebuild it with "
            f"`tokenrouter distill --out {path}` or pass another path"
        )
    with safe_open(str(path), framework="pt") as f:
        md = f.metadata() or {}
        sd = {key: f.get_tensor(key) for key in f.keys()}
    try:
        k, m = int(md["k"]), int(md["m"])
    except (KeyError, ValueError) as e:
        raise DraftMismatchError(f"{path}: not a self-draft file (no k/m metadata)") from e
    if k + m > 4 * large.config.num_hidden_layers or k >= large.config.num_hidden_layers:
        raise DraftMismatchError(f"{path}: k={k} does not fit a {large.config.num_hidden_layers}-layer model")
    extra, norm = init_trainable(large, m)
    try:
        norm.load_state_dict({k2[5:]: v for k2, v in sd.items() if k2.startswith("norm.")})
        for j, layer in enumerate(extra):
            pre = f"layers.{j}."
            layer.load_state_dict({k2[len(pre) :]: v for k2, v in sd.items() if k2.startswith(pre)})
    except RuntimeError as e:
        raise DraftMismatchError(f"{path} was trained for another model ({md.get('base', '?')}): {e}") from e
    p = next(large.parameters())
    for mod in [*extra, norm]:
        mod.to(device=p.device, dtype=p.dtype).requires_grad_(False).eval()
    return attach_layers(large, k, extra, norm)
