"""Each layer's attention parameters, read once from the model itself when a runner is built.

What a transformers decoder layer computes in attention is decided by the keywords its attention
module passes to the attention function (``attention_interface(self, q, k, v, mask, scaling=...,
sliding_window=..., softcap=..., **kwargs)`` in ``modeling_gemma2.py``, ``modeling_qwen2.py``,
``modeling_mistral.py``, ...) and by the masks its model builds from the config (``layer_types``,
``sliding_window``, ``use_bidirectional_attention``, ``attention_chunk_size``). `read_spec` asks the
model: it calls every layer's attention module once on one zero token with a recording argument
that the paged attention function (`tokenrouter_sdk.backends.attention.hf`) catches before any
output projection runs (no collective of a tensor-parallel shard runs, no KV is written), and keeps
the keywords each layer passed. Those become the `LayerParams` that every forward (the
transformers one, the native one, compiled and CUDA-graph steps) and every attention backend
take, so they cannot disagree. vLLM and SGLang carry the same per-layer window, soft-cap and scale
through their attention backends.

Refused, at load time, with an `UnsupportedAttention` naming the model, the layer and the feature
(``allow_unknown_attention=True`` runs such a model anyway, computing causal attention with the
parameters that are known, at the user's risk):
- a keyword the paged attention does not compute (e.g. gpt-oss's attention sinks ``s_aux``);
- a layer that does not call the attention function (a recurrent or linear-attention layer keeps
  a state of its own that the paged KV cache does not hold), a ``layer_types`` entry other than
  full or sliding attention, non-causal attention, chunked attention;
- a transformation of the logits after the LM head that the runner does not apply
  (``final_logit_softcapping`` outside the Gemma families that apply it, Granite's
  ``logits_scaling``, Cohere's ``logit_scale``): the runner calls the decoder and the LM head
  itself, so it applies what it knows (Gemma 2/3's final-logit soft-capping) and refuses the rest.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

# keywords of the attention function whose meaning the paged attention computes (the values of
# dropout are ignored: steps run in inference), or that carry no attention semantics
HONOURED = ("scaling", "sliding_window", "softcap")
IGNORED = ("dropout", "position_ids", "cache_position", "use_cache", "output_attentions", "is_causal")

# model types whose causal-LM forward soft-caps the logits by config.final_logit_softcapping
FINAL_SOFTCAP_TYPES = ("gemma2", "gemma3", "gemma3_text")

# config fields that change the logits after the LM head, which the runner does not apply
POST_HEAD_FIELDS = {
    "logits_scaling": "logit scaling after the LM head (logits_scaling)",
    "logit_scale": "logit scaling after the LM head (logit_scale)",
}

LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedAttention(ValueError):
    """A model computes an attention feature the paged attention does not (names the model, the
    layer and the feature, and how to run it anyway)."""


@dataclass(frozen=True)
class LayerParams:
    """What one layer's attention computes, besides causal softmax attention.

    Attributes:
        window: keys a query sees, its own included (transformers' ``sliding_window``: the query
            at position p sees keys p - window + 1 .. p), or None: every earlier key.
        softcap: attention logits become ``softcap * tanh(s / softcap)`` (Gemma 2's
            ``attn_logit_softcapping``), or None.
        scale: multiplies q . k (``scaling``: head_dim ** -0.5, or ``query_pre_attn_scalar ** -0.5``
            on Gemma 2/3, ``attention_multiplier`` on Granite, ...).
    """

    window: int | None
    softcap: float | None
    scale: float


@dataclass(frozen=True)
class AttentionSpec:
    """The attention parameters of a whole model, indexed by the pool layer (``layer_idx``).

    Attributes:
        model: the model's class name (for messages).
        layers: one `LayerParams` per layer.
        final_softcap: the logits become ``c * tanh(logits / c)`` after the LM head
            (``final_logit_softcapping`` of Gemma 2/3), or None.
        windows: the distinct windows of the layers, full attention (None) first if any layer has
            it; view: per layer, the index of its window in ``windows`` (a step builds its key
            tables once per window, not once per layer).
        ignored: the unknown features ``allow_unknown_attention`` let through (empty otherwise).
    """

    model: str
    layers: tuple[LayerParams, ...]
    final_softcap: float | None = None
    ignored: tuple[str, ...] = ()
    windows: tuple[int | None, ...] = field(init=False)
    view: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        ws = tuple(sorted({p.window for p in self.layers}, key=lambda w: -1 if w is None else w))
        object.__setattr__(self, "windows", ws)
        object.__setattr__(self, "view", tuple(ws.index(p.window) for p in self.layers))

    @classmethod
    def uniform(cls, model: str, layers: int, scale: float) -> "AttentionSpec":
        """``layers`` layers of plain causal attention with one ``scale`` (Llama-style)."""
        return cls(model, (LayerParams(None, None, float(scale)),) * layers)

    @property
    def plain(self) -> bool:
        """No layer has a window or a soft-cap, and no final soft-cap (Llama, Qwen3, ...)."""
        return self.final_softcap is None and all(p.window is None and p.softcap is None for p in self.layers)

    def describe(self) -> str:
        """One line: which layers have which window, soft-cap and scale."""
        groups: dict[LayerParams, list[int]] = {}
        for i, p in enumerate(self.layers):
            groups.setdefault(p, []).append(i)
        parts = []
        for p, idx in groups.items():
            what = [f"window {p.window}" if p.window else "full attention", f"scale {p.scale:.6g}"]
            if p.softcap:
                what.append(f"soft-cap {p.softcap:g}")
            parts.append(f"layers {_ranges(idx)}: {', '.join(what)}")
        if self.final_softcap:
            parts.append(f"final-logit soft-cap {self.final_softcap:g}")
        return "; ".join(parts)


def _ranges(idx: list[int]) -> str:
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


class _Probed(Exception):
    """Raised by the paged attention function once it recorded a probe's keywords."""


def _refuse(model_name: str, where: str, feature: str) -> UnsupportedAttention:
    return UnsupportedAttention(
        f"{model_name}: {where} uses {feature}, which tokenrouter's runner does not compute: its outputs would "
        f"differ from the model's. allow_unknown_attention=True (TorchRunner, EngineConfig, Router, "
        f"--allow-unknown-attention) runs it anyway, computing causal attention with the known parameters "
        f"(see docs/own-models.md)"
    )


def _decoder(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)


def _position_embeddings(dec, attn, layer_idx: int, x: torch.Tensor):
    """The (cos, sin) the decoder would hand layer ``layer_idx`` for position 0, or None."""
    rotary = getattr(dec, "rotary_emb", None)
    if rotary is None:
        return None
    pos = torch.zeros(1, 1, dtype=torch.long, device=x.device)
    params = inspect.signature(rotary.forward).parameters
    if "layer_type" in params:
        kind = getattr(attn, "layer_type", None) or dec.config.layer_types[layer_idx]
        return rotary(x, pos, kind)
    return rotary(x, pos)


@torch.inference_mode()
def probe_layers(model) -> list[dict | str]:
    """Per decoder layer, the keywords its attention module passed to the attention function
    (``"_head_dim"``: the query's head size), or a sentence saying why none were recorded. The
    model's attention implementation must be the paged one (`tokenrouter_sdk.backends.attention.hf`)."""
    dec = _decoder(model)
    cfg = model.config
    p = next(model.parameters())
    x = torch.zeros(1, 1, cfg.hidden_size, dtype=p.dtype, device=p.device)
    out: list[dict | str] = []
    for i, layer in enumerate(dec.layers):
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        if attn is None:
            out.append(f"has no self_attn module ({type(layer).__name__})")
            continue
        rec: dict = {}
        try:
            pe = _position_embeddings(dec, attn, i, x)
            kw = {"position_embeddings": pe} if pe is not None else {}
            attn(hidden_states=x, attention_mask=None, tr_probe=rec, **kw)
        except _Probed:
            out.append(rec)
            continue
        except Exception as e:  # noqa: BLE001 - reported as the reason the layer is refused
            out.append(f"could not be probed ({type(e).__name__}: {e})")
            continue
        out.append(f"did not call the attention function ({type(attn).__name__})")
    return out


def read_spec(model, *, allow_unknown: bool = False, probes: list | None = None) -> AttentionSpec:
    """The `AttentionSpec` of ``model`` (see the module docstring); ``probes``: `probe_layers`'s
    result when already taken.

    Raises:
        UnsupportedAttention: a feature the paged attention does not compute (unless
            ``allow_unknown``, which records it in ``ignored`` instead).
    """
    name = type(model).__name__
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    ignored: list[str] = []

    def refuse(where: str, feature: str):
        if not allow_unknown:
            raise _refuse(name, where, feature)
        ignored.append(f"{where}: {feature}")

    # model-level features, read from the config (the masks and the head are built from it)
    types = getattr(cfg, "layer_types", None) or ()
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            refuse(f"layer {i}", f"layer type {t!r} (the paged attention computes {', '.join(LAYER_TYPES)})")
    if getattr(cfg, "use_bidirectional_attention", False):
        refuse("every layer", "bidirectional attention (use_bidirectional_attention)")
    if getattr(cfg, "attention_chunk_size", None):
        refuse("the model", f"chunked attention (attention_chunk_size={cfg.attention_chunk_size})")
    final = getattr(cfg, "final_logit_softcapping", None) or None
    if final is not None and kind not in FINAL_SOFTCAP_TYPES:
        refuse("the LM head", f"final-logit soft-capping (final_logit_softcapping={final}) on model type {kind!r}")
        final = None
    for attr, what in POST_HEAD_FIELDS.items():
        val = getattr(cfg, attr, None)
        if val not in (None, 1, 1.0):
            refuse("the LM head", f"{what} = {val}")

    dec = _decoder(model)
    probes = probe_layers(model) if probes is None else probes
    layers: dict[int, LayerParams] = {}
    for i, (layer, rec) in enumerate(zip(dec.layers, probes)):
        attn = getattr(layer, "self_attn", None)
        idx = getattr(attn, "layer_idx", i)
        if not isinstance(rec, dict):
            refuse(f"layer {i}", f"an attention module that {rec}")
            rec = {}
        if getattr(attn, "is_causal", True) is False or rec.get("is_causal", True) is False:
            refuse(f"layer {i}", "non-causal attention (is_causal=False)")
        for key in sorted(set(rec) - set(HONOURED) - set(IGNORED) - {"_head_dim"}):
            refuse(f"layer {i}", f"the attention keyword {key!r}")
        head_dim = rec.get("_head_dim") or getattr(attn, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        scale = rec.get("scaling")
        window = rec.get("sliding_window")
        softcap = rec.get("softcap")
        if window is not None and (not isinstance(window, int) or window < 1):
            refuse(f"layer {i}", f"sliding_window={window!r} (expected a positive int)")
            window = None
        layers[idx] = LayerParams(
            window=window,
            softcap=float(softcap) if softcap else None,
            scale=float(scale) if scale is not None else float(head_dim) ** -0.5,
        )
    n = len(dec.layers)
    if sorted(layers) != list(range(n)):
        raise UnsupportedAttention(
            f"{name}: the attention modules' layer_idx are {sorted(layers)}, not 0..{n - 1}: "
            f"each layer needs its own KV pool layer"
        )
    return AttentionSpec(name, tuple(layers[i] for i in range(n)), float(final) if final else None, tuple(ignored))
