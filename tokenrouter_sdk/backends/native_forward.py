"""The native forward: the decoder of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) run
directly over a step's packed tokens and the paged KV pool, without the transformers forward.

It reads the model's own modules and weights and computes what their forward computes, in the
same order and dtype (so on float64 models its logits equal the transformers forward's exactly),
with less work per step:
- q/k/v and gate/up run as one GEMM each over merged weights, prepacked for oneDNN on a CPU
  where that measured faster (`tokenrouter_sdk.backends.projection`); the residual adds after
  o_proj and down_proj are fused into their GEMMs there;
- the rotary cos/sin are computed once per step, not once per layer, and applied with one roll
  (rotate_half's signs folded into the sine) instead of slices, a negation and a concatenation;
- no attention masks, cache objects or keyword plumbing: one attention call per layer into the
  paged attention (`tokenrouter_sdk.backends.attention.attend_tokens`), which takes each layer's
  window, soft-cap and scale from the runner's `AttentionSpec` (the transformers forward's too).
vLLM, SGLang and nano-vllm run their own model implementations for the same reasons (merged
QKV and gate-up linears, fused residual adds); transformers remains the fallback here for every
other architecture (`native_support` says why a model is not taken).

What it saves per step is measured in ``docs/benchmarks.md`` ("The native forward, processes and
core lending (CPU)").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused_layers
from .attention.interface import attend_tokens
from .autotune import tune_packing
from .projection import Watch, projection

# model_type -> (decoder layer class, RMSNorm class): architectures whose layers compute
# x + attn(norm(x)), then x + mlp(norm(x)), with SiLU-gated MLPs and rotate-half rotary embeddings
FAMILIES = {
    "llama": ("LlamaDecoderLayer", "LlamaRMSNorm"),
    "mistral": ("MistralDecoderLayer", "MistralRMSNorm"),
    "qwen2": ("Qwen2DecoderLayer", "Qwen2RMSNorm"),
    "qwen3": ("Qwen3DecoderLayer", "Qwen3RMSNorm"),
}


def native_support(model) -> str | None:
    """None when `NativeForward` computes ``model``'s forward; else why not (a sentence)."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} has no native forward (those with one: {sorted(FAMILIES)})"
    layer_cls, norm_cls = FAMILIES[kind]
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if dec is None or not hasattr(dec, "layers") or not hasattr(dec, "rotary_emb"):
        return f"{type(model).__name__} has no decoder with layers and a rotary embedding"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (the native forward computes SiLU-gated MLPs)"
    if type(dec.embed_tokens).__name__ != "Embedding" or type(dec.norm).__name__ != norm_cls:
        return f"{type(model).__name__}'s embedding or final norm is not the {kind} one"
    for i, layer in enumerate(dec.layers):
        if type(layer).__name__ != layer_cls:
            return f"layer {i} is a {type(layer).__name__}, not a {layer_cls}"
        attn = layer.self_attn
        if getattr(attn, "layer_idx", i) != i:
            return f"layer {i}'s attention has layer_idx {attn.layer_idx}"
        for norm in (
            layer.input_layernorm,
            layer.post_attention_layernorm,
            *(getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)),
        ):
            if type(norm).__name__ != norm_cls:
                return f"layer {i} has a {type(norm).__name__} where {norm_cls} was expected"
        if type(layer.mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            return f"layer {i}'s MLP activation is {type(layer.mlp.act_fn).__name__}, not SiLU"
    return None


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """``norm(x)`` of a Llama-family RMSNorm, in its own arithmetic: float32 statistics, the
    normalised input cast back to its dtype, then scaled by the weight. x [..., H]. Float32 inputs
    take torch's fused kernel of the same formula."""
    w = norm.weight
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, norm.variance_epsilon)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return w * h.to(x.dtype)


def _library_forward(cls) -> bool:
    """Whether ``cls.forward`` is defined by transformers or torch (what the native forward
    reproduces), not by other code (a subclass's override, a patch of the class's method)."""
    return (getattr(cls.forward, "__module__", None) or "").startswith(("transformers.", "torch."))


class NativeForward:
    """The forward of a Llama-family ``model`` over one step (see the module docstring).

    Args:
        model: a causal LM that `native_support` accepts, attention already switched to the paged
            one (its layers' ``layer_idx`` index the KV pool).
        attend: the paged attention: ``attend(fb, layer, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D])
            -> [T, H, D]`` (the layer's parameters come with ``fb``).
        pack: prepack projection weights where it pays (`tokenrouter_sdk.backends.projection`).
        release: free the model's own copy of each projection weight as soon as its packed copy
            is made (`Projection.release_plain`; not for weights tied to another parameter), so the
            build never holds two copies of the model: for a model only this forward reads.

    Raises:
        ValueError: ``model`` is not supported (`native_support`'s reason).
    """

    def __init__(self, model, attend, *, pack: bool = True, release: bool = False):
        why = native_support(model)
        if why is not None:
            raise ValueError(f"no native forward for {type(model).__name__}: {why}; use model_impl='transformers'")
        self.model, self.attend, self.pack, self.release = model, attend, pack, release
        self.released_bytes = 0  # the model's own projection weights freed (`release_plain`)
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self._plan: list | None = None
        self._head = None
        self._watched = Watch()
        self._modules: list = []
        self._module_types: list = []  # per module, its class at the last build
        self._module_dicts: list = []  # per module, its attribute dict (hooks, a patched forward)
        self._classes: set = set()  # the module classes at the last build
        self._linears: set[int] = set()
        self._hooked: set[int] = set()
        self._skinny_tuned = False  # the few-row kernel measured for the current projections
        self._layer_calls: fused_layers.LayerCalls | None = None

    def _build(self) -> None:
        """Projections of every layer and of the LM head (shared with every other NativeForward
        over the same modules in this process), and what they were built from: the weights and
        the modules in place (`_valid` checks them before every step)."""
        dec, model = self.decoder, self.model
        tied = self._tied_storages() if self.release else set()

        def proj(owner, *names):
            p = projection(owner, names, pack=self.pack)
            if self.release and not any(getattr(owner, n).weight.untyped_storage().data_ptr() in tied for n in names):
                self.released_bytes += p.release_plain()
            return p

        self._plan = [
            (
                proj(ly.self_attn, "q_proj", "k_proj", "v_proj"),
                proj(ly.self_attn, "o_proj"),
                proj(ly.mlp, "gate_proj", "up_proj"),
                proj(ly.mlp, "down_proj"),
            )
            for ly in dec.layers
        ]
        out = model.get_output_embeddings()
        name = next((n for n, mod in model.named_children() if mod is out), None)
        if name is None:
            raise ValueError(f"{type(model).__name__}'s output embedding is not a direct child module")
        self._head = proj(model, name)
        projs = [*(q for ps in self._plan for q in ps), self._head]
        tune_packing(projs)  # which GEMM path runs per step size: measured on this machine once
        self._skinny_tuned = False
        self._layer_calls = fused_layers.LayerCalls(dec, projs) if fused_layers.enabled() else None
        self._modules = [*dec.modules(), out]
        self._module_types = [type(m) for m in self._modules]
        self._classes = set(self._module_types)
        self._module_dicts = [m.__dict__ for m in self._modules]  # read directly: fewer lookups a step
        # the modules read, where they hang: a replaced one (a wrapper, a new layer list) rebuilds
        self._head_name = name
        self._build_watch()
        self._linears = {id(m) for p in projs for m in p.mods}
        self._hooked = {i for i in self._hooked_modules() if i in self._linears}

    def _build_watch(self) -> None:
        """What `_valid` checks: the modules in place and every projection's weights as they are."""
        dec, model = self.decoder, self.model
        out = model.get_output_embeddings()
        places = [(model, self._head_name, out), (dec, "layers", dec.layers)] + [
            (parent, child, mod) for parent in dec.modules() for child, mod in parent.named_children()
        ]
        self._watched = Watch((o, a, m, None) for o, a, m in places)
        for p in self.projections:
            self._watched.extend(p.watch())

    def _hooked_modules(self) -> set[int]:
        """Ids of the modules whose call this forward cannot stand in for: with forward hooks or
        pre-hooks, a ``forward`` set on the instance (an ablation or steering patch, accelerate's
        hooks), a class changed since the build (a swapped ``__class__``), or a class whose
        ``forward`` is not transformers' or torch's own (a subclass that overrides it, or the
        class's ``forward`` patched)."""
        hooked = {
            id(m)
            for m, d, t in zip(self._modules, self._module_dicts, self._module_types)
            if d["_forward_hooks"] or d["_forward_pre_hooks"] or "forward" in d or type(m) is not t
        }
        foreign = {t for t in self._classes if not _library_forward(t)}
        if foreign:
            hooked.update(id(m) for m, t in zip(self._modules, self._module_types) if t in foreign)
        return hooked

    def _types_changed(self) -> bool:
        """Whether a module's class changed since `_build`."""
        return any(type(m) is not t for m, t in zip(self._modules, self._module_types))

    def _valid(self) -> bool:
        """Whether no module was replaced and no projection weight changed (replaced, converted
        or written in place) since `_build`."""
        return self._plan is not None and len(self._plan) == len(self.decoder.layers) and self._watched.unchanged()

    def prepare(self) -> bool:
        """Bring the projections up to date with the model (rebuilt when it changed) and say
        whether this forward computes the next step as the model's own would: False when a
        module whose forward it does not call has forward hooks, a forward set on the instance
        or a swapped class (`_hooked_modules`), or a global module hook is registered (activation
        capture, steering or patching on layers, attention, MLPs, norms: such steps must run the
        transformers forward). Hooks and patched forwards on the projections' linears run here:
        those linears are then called as modules."""
        hooked = self._hooked_modules() if self._plan is not None else set()
        if (
            not self._valid()
            or (hooked & self._linears) != self._hooked
            or (hooked - self._linears and self._types_changed())
        ):  # a class swapped (back): rebuilt
            self._build()
            hooked = self._hooked_modules()
        g = torch.nn.modules.module
        if g._global_forward_hooks or g._global_forward_pre_hooks:
            return False
        return not (hooked - self._linears)

    def add_skinny(self) -> None:
        """Once the C++ CPU kernels are loaded: give each float32 projection its few-row kernel
        weight and measure again where it runs (a choice stored with it is read, not measured);
        the weights of projections whose rule never runs it are dropped again."""
        self._skinny_tuned = True
        ops = torch.ops.tokenrouter_cpu
        projs = self.projections
        if any([p.add_skinny(ops) for p in projs]):
            tune_packing(projs)

    def _tied_storages(self) -> set[int]:
        """Storages that a module other than a linear also holds (tied input embeddings share
        the LM head's weight)."""
        return {
            t.untyped_storage().data_ptr()
            for m in self.model.modules()
            if not isinstance(m, torch.nn.Linear)
            for t in [*m._parameters.values(), *m._buffers.values()]
            if isinstance(t, torch.Tensor)
        }

    def release_plain(self) -> int:
        """Free the model's own copy of every projection weight that has a packed copy
        (`Projection.release_plain`), except weights whose storage another parameter or buffer
        of the model shares (tied input embeddings). For a model only this forward reads:
        afterwards the transformers forward, training and the naive reference cannot run on it.
        Returns the bytes freed. Call `prepare` first."""
        tied = self._tied_storages()
        freed = 0
        for p in self.projections:
            if p.plain and not any(m.weight.untyped_storage().data_ptr() in tied for m in p.mods):
                freed += p.release_plain()
        self.released_bytes += freed
        self._build_watch()
        return freed

    @property
    def projections(self) -> list:
        """Every projection in the order `decoder_step` uses them: per layer q/k/v, o, gate/up,
        down, then the LM head (after `prepare`)."""
        return [*(p for ps in self._plan for p in ps), self._head]

    @torch.inference_mode()
    def __call__(
        self,
        fb,
        ids: torch.Tensor,
        pos: torch.Tensor,
        last: torch.Tensor,
        want_all: bool = False,
        between=None,
        ops=None,
    ):
        """One step: ids [T] token ids, pos [T] positions, last [B] each request's last packed
        index, ``fb`` the step's `ForwardBatch`; ``between``: called between two layers; ``ops``:
        fused float32 or bfloat16 CPU ops (`tokenrouter_sdk.backends.cpu_kernels.step_ops`) or None. Returns
        (logits [B, V], hidden [B, H], the final hidden states of every fed position [T, H] when
        ``want_all``, else None). Call `prepare` first."""
        if ops is not None and not self._skinny_tuned:
            self.add_skinny()
        fused = stack = None
        calls = self._layer_calls
        mode = calls.mode(fb) if ops is not None and calls is not None and self.attend is attend_tokens else None
        if mode is not None:
            whole = mode == "whole"

            def fused(i, x, cos, sin):
                return calls.run(fb, i, x, cos, sin, whole)

            if whole and between is None:

                def stack(x, cos, sin):
                    return calls.run_stack(fb, x, cos, sin)

        logits, hidden, h = decoder_step(
            self.decoder, self.projections, lambda *a: self.attend(fb, *a), ids, pos, last, between, ops, fused, stack
        )
        return logits, hidden, (h if want_all else None)


def decoder_step(
    dec,
    projections,
    attend,
    ids: torch.Tensor,
    pos: torch.Tensor,
    last: torch.Tensor,
    between=None,
    ops=None,
    fused=None,
    stack=None,
):
    """The native forward's arithmetic, shared by eager steps (`NativeForward`) and compiled
    ones (`tokenrouter_sdk.backends.compiled_step`).

    Args:
        dec: the model's decoder (embedding, rotary embedding, layers, final norm).
        projections: callables in `NativeForward.projections` order; ``p(x [M, in])`` returns one
            output per merged linear, ``p(x, residual)`` returns ``residual + x W^T + b``.
        attend: ``attend(layer, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]``.
        ids, pos: [T] token ids and positions; last: [B] each request's last packed index.
        between: None, or called after each layer (no arguments).
        ops: None (ATen ops), or fused ops for the work between the GEMMs, with ``rms_norm(x,
            norm)``, ``rope(t [T, H, D], cos [T, D], sin [T, D])`` (sin with rotate_half's signs
            folded in) and ``silu_mul(g, u)`` (`tokenrouter_sdk.backends.cpu_kernels.StepOps`:
            float32 or bfloat16 on a CPU; equal to the ATen ops within rounding).
        fused: None, or with ``ops``: ``fused(i, x [T, C], cos [T, D], sin [T, D])`` runs layer
            ``i`` in one call and returns its output, or returns None for the loop to run it
            (`tokenrouter_sdk.backends.fused_layers.LayerCalls.run`: the same kernels, the same bits).
        stack: None, or with ``ops``: ``stack(x [T, C], cos [T, D], sin [T, D])`` runs every layer
            in one call and returns the last one's output, or returns None for the layers to run
            one by one (`tokenrouter_sdk.backends.fused_layers.LayerCalls.run_stack`: the same bits).

    Returns:
        (logits [B, V], hidden [B, H], final hidden states of every position [T, H]).
    """
    x = F.embedding(ids, dec.embed_tokens.weight)  # [T, H]
    cos, sin = dec.rotary_emb(x[None], pos[None])  # [1, T, D] each
    half = cos.shape[-1] // 2
    cos = cos[0, :, None]  # [T, 1, D]
    sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1)[:, None]  # rotate_half's signs folded in

    def rope(t):  # t * cos + rotate_half(t) * sin, where rotate_half(t) = roll(t, half) with signs
        return t * cos + torch.roll(t, half, -1) * sin

    norm = rms_norm
    if ops is not None:
        cos2, sin2 = cos[:, 0], sin[:, 0]
        norm = ops.rms_norm

        def rope(t):
            return ops.rope(t, cos2, sin2)

    n = x.shape[0]
    y = stack(x, cos2, sin2) if stack is not None else None
    if y is not None:
        x = y
    for i, layer in enumerate(dec.layers if y is None else ()):
        y = fused(i, x, cos2, sin2) if fused is not None else None
        if y is not None:
            x = y
            if between is not None:
                between()
            continue
        qkv, o, gate_up, down = projections[4 * i : 4 * i + 4]
        a = layer.self_attn
        d = a.head_dim
        q, k, v = qkv(norm(x, layer.input_layernorm))
        q, k, v = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)
        if hasattr(a, "q_norm"):
            q, k = norm(q, a.q_norm), norm(k, a.k_norm)
        y = attend(a.layer_idx, rope(q), rope(k), v)
        x = o(y.reshape(n, -1), x)
        g, u = gate_up(norm(x, layer.post_attention_layernorm))
        x = down(F.silu(g).mul_(u) if ops is None else ops.silu_mul(g, u), x)
        if between is not None:
            between()
    h = norm(x, dec.norm)
    hidden = h[last]
    return projections[-1](hidden)[0], hidden, h
