"""The torch backend: one packed forward of any `transformers` causal LM over a ragged batch
that mixes prefill, decode and extend, with K/V kept in our own paged `KVPool`.

How: the batch is packed into one [1, T] sequence (T = sum of the fed suffix lengths) with
per-token ``position_ids``; a custom attention function (registered with transformers'
``AttentionInterface`` under ``ATTN_NAME``, with a mask function that returns None) writes the
new K/V into the pool slots and attends each request to its own cached prefix. Decodes are
attended together in one padded SDPA call (with grouped-query attention, the query heads that
share a KV head are folded into the query-length dimension, so K/V are never repeated per query
head); prefills and extends one by one. Only the last position of each request goes through the
LM head (never full-sequence logits).
When the forward carries no ``tr_batch`` keyword, the function falls back to plain SDPA, so
the model still works for ordinary, unpadded use.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..engine.kv_pool import KVPool
from ..engine.runner import ForwardOut, SeqInput
from ..engine.config import KERNEL_MODES, MODEL_IMPLS
from . import cpu_kernels
from .native_forward import NativeForward, native_support

ATTN_NAME = "tokenrouter_paged"


@dataclass
class ForwardBatch:
    """Per-step attention metadata shared by all layers (built once per step).

    Attributes:
        pool: the model's KV pool.
        slot_mapping: pool slot of every fed token, shape [T].
        dec_q: packed indices of decode tokens, shape [Bd] (or None).
        dec_kv: pool slots of each decode request's keys, padded, shape [Bd, Lmax].
        dec_mask: key padding mask, shape [Bd, 1, 1, Lmax], or None when unpadded.
        segs: prefill/extend requests as (q_start, q_len, kv_slots [L], mask [q_len, L] | None).
        dec_qlen: queries per decode request, Q (1 in eager steps; a fixed-shape step
            (`DecodeGraphs`) feeds every request Q padded tokens: then dec_q has shape [Bd * Q],
            request-major, and dec_mask [Bd, 1, Q, Lmax]).
        dec_shared: leading key positions that every decode request reads from the same pool
            slots (prefix-cache blocks their tables share), a multiple of the block size.
        kern: requests the in-place CPU kernel attends (`tokenrouter_sdk.backends.cpu_kernels`),
            or None: (op, table [R, Lmax] pool slots, q_start [R], q_len [R], kv_len [R]); their
            tokens are in neither ``dec_q`` nor ``segs``.
    """

    pool: KVPool
    slot_mapping: torch.Tensor
    dec_q: torch.Tensor | None
    dec_kv: torch.Tensor | None
    dec_mask: torch.Tensor | None
    segs: list
    dec_qlen: int = 1
    dec_shared: int = 0
    kern: tuple | None = None


def _sdpa(q, k, v, mask, is_causal, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _attend(q, k, v, mask, scale):
    """Attention with an explicit key mask (or none), not causal. q [B, H, Q, D], k/v [B, Hkv, L, D],
    mask broadcastable to [B, 1, Q, L] (bool, True = attend) or None; returns [B, H, Q, D].

    With grouped-query attention (H = g * Hkv) the g query heads of each KV head are folded into
    the query dimension ([B, Hkv, g*Q, D]; query head j*g + i uses KV head j, as transformers'
    ``repeat_kv``), so K/V are never repeated, and SDPA's fused kernels take the mask: with
    ``enable_gqa`` and a mask, CUDA falls back to the math kernel, which materialises the scores."""
    b, h, nq, d = q.shape
    g = h // k.shape[1]
    if g == 1:
        return _sdpa(q, k, v, mask, False, scale)
    q = q.reshape(b, k.shape[1], g * nq, d)
    if mask is not None and nq > 1 and mask.shape[-2] > 1:
        mask = mask.repeat(*([1] * (mask.dim() - 2)), g, 1)
    return _sdpa(q, k, v, mask, False, scale).reshape(b, h, nq, d)


def paged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    tr_batch: ForwardBatch | None = None, tr_op: bool = False, **kwargs):
    """Attention over the paged KV pool. query [1, H, T, D], key/value [1, Hkv, T, D];
    returns ([1, T, H, D], None) as transformers expects. ``tr_batch``: the step's metadata (eager
    steps); ``tr_op``: a compiled step, whose metadata the custom op
    ``tokenrouter::paged_attention`` reads (`tokenrouter_sdk.backends.compiled_step`)."""
    if tr_op:
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        return torch.ops.tokenrouter.paged_attention(query, key, value, module.layer_idx, scale), None
    if tr_batch is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    return attend_paged(tr_batch, module.layer_idx, query, key, value, scaling), None


def attend_paged(fb: ForwardBatch, layer: int, query, key, value, scaling) -> torch.Tensor:
    """`attend_tokens` in transformers' layout: query [1, H, T, D], key/value [1, Hkv, T, D];
    returns [1, T, H, D]."""
    return attend_tokens(fb, layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                         scaling).unsqueeze(0)


def attend_tokens(fb: ForwardBatch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scaling) -> torch.Tensor:
    """Write the step's new K/V of ``layer`` into the pool slots of ``fb`` and attend every
    request to its cached prefix. q [T, H, D], k/v [T, Hkv, D] (any strides); returns a new
    [T, H, D] tensor."""
    kc, vc = fb.pool.k[layer], fb.pool.v[layer]
    kc.index_copy_(0, fb.slot_mapping, k)
    vc.index_copy_(0, fb.slot_mapping, v)
    t, h, d = q.shape
    if fb.kern is not None:
        return _attend_kernel(fb, kc, vc, q, k, v, scaling)
    only_decodes = not fb.segs and fb.dec_qlen == 1 and fb.dec_q is not None and fb.dec_q.shape[0] == t
    q = q.transpose(0, 1)                                               # [H, T, D]
    out = None if only_decodes else q.new_empty(t, h, d)               # [T, H, D]
    if fb.dec_q is not None:
        bd, lmax = fb.dec_kv.shape
        nq = fb.dec_qlen
        # decode token i is packed token fb.dec_q[i]; in a step of decodes only, token i itself
        qd = q.unsqueeze(2).transpose(0, 1) if only_decodes else q[:, fb.dec_q].view(h, bd, nq, d).transpose(0, 1)
        if (bd - 1) * fb.dec_shared >= CASCADE_MIN_SAVED and nq == 1 and kc.device.type == "cpu":
            od = _attend_cascade(fb, kc, vc, qd, scaling)              # [Bd, H, Q, D]
        else:
            flat = fb.dec_kv.view(-1)
            kd = kc.index_select(0, flat).view(bd, lmax, *kc.shape[1:]).transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = vc.index_select(0, flat).view(bd, lmax, *vc.shape[1:]).transpose(1, 2)
            od = _attend(qd, kd, vd, fb.dec_mask, scaling)             # [Bd, H, Q, D]
        if only_decodes:
            return od.transpose(1, 2).reshape(t, h, d)
        out[fb.dec_q] = od.transpose(1, 2).reshape(bd * nq, h, d)
    for qs, ql, slots, mask in fb.segs:
        out[qs:qs + ql] = _attend_seg(q[:, qs:qs + ql].unsqueeze(0), kc, vc, k, v, qs, ql, slots, mask, scaling)
    return out


def _attend_seg(qi, kc, vc, k, v, qs, ql, slots, mask, scaling) -> torch.Tensor:
    """One prefill or extend: qi [1, H, ql, D] (packed rows qs..qs+ql-1); returns [ql, H, D]. A
    prefill from position 0 attends the step's own k/v [T, Hkv, D] rows (what it just wrote to
    the pool); an extend gathers its cached keys from the pool."""
    if mask is None:  # prefill: causal from position 0, its keys are the fed tokens'
        ki = k[qs:qs + ql].transpose(0, 1).unsqueeze(0)                # [1, Hkv, ql, D]
        vi = v[qs:qs + ql].transpose(0, 1).unsqueeze(0)
        return _sdpa(qi, ki, vi, None, ql > 1, scaling)[0].transpose(0, 1)
    ki = kc.index_select(0, slots).transpose(0, 1).unsqueeze(0)        # [1, Hkv, L, D]
    vi = vc.index_select(0, slots).transpose(0, 1).unsqueeze(0)
    return _attend(qi, ki, vi, mask, scaling)[0].transpose(0, 1)       # extend: query i sees keys j <= start + i


def _attend_kernel(fb: ForwardBatch, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, scaling) -> torch.Tensor:
    """The step's attention with the in-place CPU kernel for the requests in ``fb.kern`` and SDPA
    for the rest (prefills, long extends). q [T, H, D], k/v [T, Hkv, D]; returns [T, H, D]."""
    op, table, q_start, q_len, kv_len = fb.kern
    t, h, d = q.shape
    q = q.contiguous()
    out = q.new_empty(t, h, d)
    scale = float(scaling) if scaling is not None else d ** -0.5
    op(out, q, kc, vc, table, q_start, q_len, kv_len, scale)
    for qs, ql, slots, mask in fb.segs:
        out[qs:qs + ql] = _attend_seg(q[qs:qs + ql].transpose(0, 1).unsqueeze(0), kc, vc, k, v, qs, ql, slots,
                                      mask, scaling)
    return out


KERNEL_WAIT_S = 600.0  # the longest a kernels="wait" step waits for the C++ kernels' build

# Queries of one extend the in-place kernel attends (more go to SDPA over a gathered copy, whose
# GEMMs beat the kernel's per-query loops once a request feeds many tokens).
KERNEL_MAX_QUERIES = 16

# Shared key reads a decode step must save, (requests - 1) x shared positions, before it attends
# the shared keys once for all (`_attend_cascade`): its unfused arithmetic costs about twice one
# padded SDPA call, so it pays only when the saved copies are many (30 layers of SmolLM2-135M's
# shapes on 2 CPU cores, `evals/investigations/paged_gather_cost.py`: 2 requests x 1,200 keys,
# 32 shared, 29 against 92 ms; 4 x 800, 736 shared, 84 against 39 ms; 16 x 800, 276 against 72).
CASCADE_MIN_SAVED = 2048


def _softmax_parts(scores: torch.Tensor, values: torch.Tensor):
    """Unnormalised attention over one key range: (max score [.., 1], sum of exp [.., 1],
    exp-weighted values [.., D]). A row whose keys are all masked (-inf) gives zeros."""
    m = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).min)
    p = torch.exp(scores - m)
    return m, p.sum(-1, keepdim=True), torch.matmul(p, values)


def _attend_cascade(fb: ForwardBatch, kc: torch.Tensor, vc: torch.Tensor, qd: torch.Tensor, scaling) -> torch.Tensor:
    """Decode attention in two parts merged by their log-sum-exp (cascade attention, as FlashInfer
    and vLLM do for shared prefixes): every query against the ``fb.dec_shared`` keys all decode
    requests share, read once, then each request against its own keys. A batch of 16 requests
    behind one 735-token prefix then reads the prefix's K/V once per layer instead of 16 times.
    qd [Bd, H, 1, D]; returns [Bd, H, 1, D], equal to `_attend` over the whole rows within
    rounding."""
    bd, lmax = fb.dec_kv.shape
    _, h, _, d = qd.shape
    hkv = kc.shape[1]
    g, ls = h // hkv, fb.dec_shared
    scale = float(scaling) if scaling is not None else d ** -0.5
    q = qd.reshape(bd, hkv, g, d)  # query head j*g + i reads KV head j
    shared = fb.dec_kv[0, :ls]
    ks, vs = kc.index_select(0, shared), vc.index_select(0, shared)  # [Ls, Hkv, D]
    qs = q.permute(1, 0, 2, 3).reshape(hkv, bd * g, d)
    m1, l1, o1 = _softmax_parts(torch.matmul(qs, ks.permute(1, 2, 0)) * scale, vs.transpose(0, 1))
    m1, l1, o1 = (x.view(hkv, bd, g, x.shape[-1]).transpose(0, 1) for x in (m1, l1, o1))  # [Bd, Hkv, g, .]
    lr = lmax - ls
    if lr == 0:
        return (o1 / l1).reshape(bd, h, 1, d)
    rest = fb.dec_kv[:, ls:].reshape(-1)
    kr = kc.index_select(0, rest).view(bd, lr, hkv, d).permute(0, 2, 3, 1)  # [Bd, Hkv, D, Lr]
    vr = vc.index_select(0, rest).view(bd, lr, hkv, d).transpose(1, 2)      # [Bd, Hkv, Lr, D]
    s2 = torch.matmul(q, kr) * scale                                        # [Bd, Hkv, g, Lr]
    if fb.dec_mask is not None:
        s2 = s2.masked_fill(~fb.dec_mask[..., ls:], float("-inf"))
    m2, l2, o2 = _softmax_parts(s2, vr)
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return ((o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)).reshape(bd, h, 1, d)


def _configure_sdpa(device: torch.device) -> None:
    """On CUDA, turn the cuDNN SDPA backend off for this process (flash, memory-efficient and
    math kernels stay): cuDNN builds an execution plan for every new query/key shape, and a decode
    step's key length changes every step (measured on an H200 with random-weight Qwen3-0.6B: about
    1.4 ms of host time per attention call, half of the step; `evals/investigations/gpu_step_profile.py`). Set
    once, not with the ``sdpa_kernel`` context per call: its flags are process-wide, and two
    sub-servers in threads entering and leaving it would undo each other's setting mid-step."""
    if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)


def _no_mask(*args, **kwargs):
    return None


def register_attention() -> None:
    """Register ``ATTN_NAME`` with transformers (idempotent; called by `TorchRunner`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)


def use_paged_attention(model) -> None:
    """Switch a model (and the configs of modules it shares, e.g. a zero-copy truncation's
    layers) to the paged attention function."""
    register_attention()
    model.set_attn_implementation(ATTN_NAME)
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and cfg._attn_implementation != ATTN_NAME:
            cfg._attn_implementation = ATTN_NAME


_SCRATCH_NEED = 4  # scratch slots a compiled runner uses: 3 for the compile's warm-up, 1 for padding


def _compile_mode(compile) -> str | None:
    if compile in (False, None, "off"):
        return None
    if compile is True or compile == "background":
        return "background"
    if compile == "wait":
        return "wait"
    raise ValueError(f"compile must be False, True, 'background' or 'wait', got {compile!r}")


def _kernel_batch(op, kern: list) -> tuple:
    """``ForwardBatch.kern`` from (q_start, q_len, kv_len, slots [kv_len]) per request."""
    table = torch.zeros(len(kern), max(k[2] for k in kern), dtype=torch.long)
    for i, (_, _, n, sl) in enumerate(kern):
        table[i, :n] = sl
    cols = torch.tensor([k[:3] for k in kern], dtype=torch.long).T.contiguous()
    return op, table, cols[0], cols[1], cols[2]


class _PadSeq:
    """A one-token padding request at position 0 whose K/V live in one scratch slot."""

    all_hidden = False

    def __init__(self, slot: int):
        self.tokens, self.start, self.table = [0], 0, []
        self.slots = torch.tensor([slot])


class TorchRunner:
    """Runs one model's packed forward over a ragged batch.

    Args:
        model: a `transformers` causal LM (Llama, Qwen2, Qwen3 families, or any whose
            decoder layers call ``ALL_ATTENTION_FUNCTIONS``). Its attention implementation is
            switched to the paged one.
        max_kv_tokens: KV pool capacity in tokens (rounded up to whole blocks).
        block_size: tokens per KV block.
        cuda_graphs: serve decode and short-extend steps from CUDA graphs (`DecodeGraphs`: one
            graph per batch, tokens-per-request and context bucket, captured on first use;
            prefills stay eager).
            Off by default. On a non-CUDA device the same fixed-shape path runs eagerly, without
            capture (for testing). If a capture raises, decode steps fall back to eager with a
            `RuntimeWarning` and ``graphs.error`` says why.
        max_graph_batch: largest batch served from a graph, requests.
        compile: serve steps from the model forward compiled by ``torch.compile`` (inductor,
            weights frozen and prepacked; attention stays the same eager paged attention, as a
            custom op: `tokenrouter_sdk.backends.compiled_step`). ``False`` (eager steps),
            ``True`` or ``"background"``: compile in a background thread at the first step and
            serve eager steps until it is ready (no step waits for the compile), ``"wait"``: the
            first step waits for the compile (every step compiled; what the tests use). If the
            compile raises, steps stay eager with a `RuntimeWarning` and ``compile_error`` says
            why. One compiled forward per model object and process, shared by its runners.
            With ``cuda_graphs`` the graph path keeps decode and short-extend steps.
        model_impl: which forward runs eager steps. ``"auto"`` (default): the native forward
            (`tokenrouter_sdk.backends.native_forward`: merged and, on a CPU, prepacked projections;
            logits equal the transformers forward's on float64, within float rounding otherwise)
            for the Llama, Mistral, Qwen2 and Qwen3 families, transformers' forward for every
            other model; ``"native"``: the native forward or a `ValueError` saying why the model
            has none; ``"transformers"``: the model's own transformers forward (no packed copy of
            the weights). Compiled and CUDA-graph steps run the transformers forward.
        kernels: the engine's C++ CPU kernels (`tokenrouter_sdk.backends.cpu_kernels`), for a
            model on a CPU with float32 or float64 weights: decode and short-extend queries (at
            most ``KERNEL_MAX_QUERIES`` tokens) attend their cached keys in place in the pool,
            with no per-step gather; float32 native steps also run their norms, rotary embedding
            and SiLU gating as fused ops. ``"auto"`` (default): once built, in the background from
            the first construction in a process (the first build takes about 15-25 s on 2 cores;
            later processes load it from the disk cache in a fraction of a second), and ATen ops
            (gather + SDPA) until then or where they cannot be built; ``"wait"``: the first step
            waits for them and raises RuntimeError if they cannot be built; ``"off"``: never.
            Outputs agree within floating-point rounding (float64 attention: about 1e-15).

    On CUDA the first forward turns the cuDNN SDPA backend off for the process (see
    `_configure_sdpa`; ``torch.backends.cuda.enable_cudnn_sdp(True)`` turns it back on).

    Attributes:
        pool: the private `KVPool` (with a scratch block when ``cuda_graphs``).
        graphs: the `DecodeGraphs`, or None without ``cuda_graphs`` (built on first use, in the
            process that runs the sub-server: graphs do not travel between processes).
        last_forward_s: seconds spent in the last model forward (for overhead metrics).
        impl: the forward eager steps run, ``"native"`` or ``"transformers"``; ``native_reason``:
            why not native (None when native).
        between_layers: None, or a callable the native forward calls between two layers of a
            step (set in a sub-server process for core lending: `tokenrouter_sdk.engine.cores`).
        last_impl: the forward the last step ran: ``"native"``, ``"transformers"`` (also a native
            runner's step while forward hooks the native forward would bypass are registered on
            the model's modules), ``"compiled"`` or ``"cuda_graphs"``.
        last_compiled: whether the last step ran the compiled forward.
        compile_s: seconds the compile took (the first compiled call in this process), or None.
        compile_error: why the compiled forward is off, or None.
    """

    def __init__(self, model, *, max_kv_tokens: int = 8192, block_size: int = 16, cuda_graphs: bool = False,
                 max_graph_batch: int = 64, compile: bool | str = False, model_impl: str = "auto",
                 kernels: str = "auto"):
        self.compile = _compile_mode(compile)
        if kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {kernels!r}")
        self.kernels = kernels
        self.model = model
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
        self.native_reason = native_support(model) if model_impl != "transformers" else "model_impl='transformers'"
        if model_impl == "native" and self.native_reason is not None:
            raise ValueError(f"model_impl='native': no native forward for {type(model).__name__}: {self.native_reason}; "
                             f"use model_impl='auto' or 'transformers'")
        self.impl = "native" if self.native_reason is None else "transformers"
        self._native = None  # the NativeForward, built in the process that runs the steps
        self.between_layers = None  # called between two layers of a native step (core lending)
        self._step_impl = self.last_impl = self.impl
        use_paged_attention(model)
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        scratch = (1 if block_size >= 2 else 2) if cuda_graphs else 0
        if self.compile:  # the compile's warm-up batch (3 tokens) and a padding token
            scratch = max(scratch, -(-_SCRATCH_NEED // block_size))
        self.pool = KVPool(cfg.num_hidden_layers, kv_heads, head_dim, -(-max_kv_tokens // block_size),
                           block_size, dtype=self.dtype, device=self.device, scratch_blocks=scratch)
        self.cuda_graphs, self.max_graph_batch = bool(cuda_graphs), max_graph_batch
        self._graphs = None
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        self.last_forward_s = 0.0
        self.last_compiled = False
        self.compile_error: str | None = None
        self._compiled = None  # the CompiledForward once usable (per process)
        self._compile_thread: threading.Thread | None = None
        self._compile_started = False
        if self._kernels_apply():
            cpu_kernels.start()

    @property
    def graphs(self):
        if self.cuda_graphs and self._graphs is None:
            from .cuda_graphs import DecodeGraphs
            self._graphs = DecodeGraphs(self, capture=self.device.type == "cuda", max_batch=self.max_graph_batch)
        return self._graphs

    def prepare_process(self) -> None:
        """Set-up in a process that unpickled this runner: register the paged attention and
        start loading the CPU kernels."""
        register_attention()
        if self._kernels_apply():
            cpu_kernels.start()

    def release(self) -> None:
        """Free the KV pool and the captured graphs and drop the model (the runner is unusable
        afterwards): a closed Router's models are freed at once, not at the next garbage
        collection of the engine's reference cycles."""
        self._graphs = None
        self._compiled = None
        self._native = None
        self.pool.release()
        self.model = self.decoder = self.lm_head = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_graphs"] = None  # CUDA graphs belong to the process that captured them
        state["_compiled"] = state["_compile_thread"] = None  # so does compiled code
        state["_native"] = None  # and packed weights
        state["between_layers"] = None
        state["_compile_started"] = False
        return state

    # -- compiled steps ---------------------------------------------------------------------
    @property
    def compile_s(self) -> float | None:
        return self._compiled.compile_s if self._compiled is not None else None

    def _start_compile(self) -> None:
        """Begin the compile (once): in a background thread, or here for ``compile="wait"``."""
        self._compile_started = True
        from .compiled_step import compiled_forward
        sizes = None
        if self.impl == "native":
            native = self._native_forward()
            native.prepare()
            sizes = [p.sizes for p in native.projections]
            if any(n is None for s in sizes for n in s):
                self.compile_error = ("the native forward has a projection module of unknown width (a wrapper "
                                      "without out_features): steps stay eager")
                warnings.warn(f"compile: {self.compile_error}", RuntimeWarning, stacklevel=3)
                return
        cf = compiled_forward(self.model, self.decoder, self.lm_head, freezing=sizes is None, sizes=sizes)
        if cf.ready.is_set():  # compiled by another runner of this model in this process
            self._compiled = cf
            return
        if self.compile == "wait":
            self._warm_up(cf)
            return
        self._compile_thread = threading.Thread(target=self._warm_up, args=(cf,), daemon=True,
                                                name="tokenrouter-compile")
        self._compile_thread.start()

    @torch.inference_mode()  # as the steps run: inference tensors (dynamo guards on it)
    def _warm_up(self, cf) -> None:
        pool = self.pool
        if pool is None or pool.k is None:
            return
        s = pool.scratch_slot
        dev = self.device
        # two prefills (2 tokens and 1) in scratch slots: T=3 and B=2, so that dynamo relates no sizes
        segs = [(0, 2, torch.tensor([s, s + 1], device=dev), None), (2, 1, torch.tensor([s + 2], device=dev), None)]
        fb = ForwardBatch(pool, torch.tensor([s, s + 1, s + 2], device=dev), None, None, None, segs)
        batch = (fb, torch.zeros(1, 3, dtype=torch.long, device=dev), torch.tensor([[0, 1, 0]], device=dev),
                 torch.tensor([1, 2], device=dev), self._native.projections if cf.native else None)
        if cf.warm_up(batch):
            self._compiled = cf
        else:
            self.compile_error = cf.error
            warnings.warn(f"torch.compile of the model forward failed, steps stay eager: {cf.error}",
                          RuntimeWarning, stacklevel=2)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Start the compile if it has not started, wait for it (at most ``timeout`` seconds) and
        return whether compiled steps are on. False at once without ``compile``."""
        if not self.compile:
            return False
        if not self._compile_started:
            self._start_compile()
        if self._compile_thread is not None:
            self._compile_thread.join(timeout)
        return self._compiled is not None

    def _batch(self, seqs: list[SeqInput], pad: bool = False) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
        """The step's `ForwardBatch`, token ids [1, T], positions [1, T] and each request's last
        packed index [B]. ``pad``: a batch of one request gets a second, one-token request that
        writes and reads only a scratch slot (compiled steps need T, B >= 2; its row is dropped)."""
        pool, dev = self.pool, self.device
        if pad and len(seqs) == 1:
            seqs = [*seqs, _PadSeq(pool.scratch_slot + _SCRATCH_NEED - 1)]
        ids, pos, slots, last = [], [], [], []
        dec_q, dec_kv, dec_len, dec_tables, segs = [], [], [], [], []
        op = self._kernel()
        kern = []  # (q_start, q_len, kv_len, slots) of the requests the kernel attends
        t = 0
        for s in seqs:
            n, end = len(s.tokens), s.start + len(s.tokens)
            ids.extend(s.tokens)
            pos.extend(range(s.start, end))
            all_slots = s.slots if isinstance(s, _PadSeq) else pool.slots(s.table, 0, end)
            slots.append(all_slots[s.start:])
            if op is not None and (n == 1 or (s.start > 0 and n <= KERNEL_MAX_QUERIES)):
                kern.append((t, n, end, all_slots))
            elif n == 1:
                dec_q.append(t)
                dec_kv.append(all_slots)
                dec_len.append(end)
                dec_tables.append(s.table)
            else:
                mask = None
                if s.start > 0:  # extend: query i sees keys j <= start + i
                    mask = (torch.arange(end)[None, :] <= torch.arange(s.start, end)[:, None]).to(dev)
                segs.append((t, n, all_slots.to(dev), mask))
            t += n
            last.append(t - 1)
        dq = dkv = dmask = None
        shared = 0
        if len(dec_tables) > 1:  # leading blocks every decode request's table shares (its last is its own)
            first, lim = dec_tables[0], min(map(len, dec_tables)) - 1
            while shared < lim and all(tb[shared] == first[shared] for tb in dec_tables[1:]):
                shared += 1
        if dec_q:
            lmax = max(dec_len)
            dkv = torch.zeros(len(dec_q), lmax, dtype=torch.long)
            for i, sl in enumerate(dec_kv):
                dkv[i, :len(sl)] = sl
            if min(dec_len) != lmax:
                dmask = (torch.arange(lmax)[None, :] < torch.tensor(dec_len)[:, None])[:, None, None, :].to(dev)
            dq, dkv = torch.tensor(dec_q, device=dev), dkv.to(dev)
        fb = ForwardBatch(pool, torch.cat(slots).to(dev), dq, dkv, dmask, segs, dec_shared=shared * pool.block_size,
                          kern=_kernel_batch(op, kern) if kern else None)
        return (fb, torch.tensor([ids], device=dev), torch.tensor([pos], device=dev),
                torch.tensor(last, device=dev))

    def _kernels_apply(self) -> bool:
        return self.kernels != "off" and self.device.type == "cpu" and self.dtype in cpu_kernels.DTYPES

    def _kernel(self):
        """The in-place paged attention op for this step, or None (gather and SDPA): see the
        ``kernels`` argument."""
        if not self._kernels_apply():
            return None
        op = cpu_kernels.paged_attention_op(wait=self.kernels == "wait", timeout=KERNEL_WAIT_S)
        if op is None and self.kernels == "wait":
            why = cpu_kernels.error() or f"still building after {KERNEL_WAIT_S:.0f} s"
            raise RuntimeError(f"kernels='wait': the C++ CPU kernels could not be built ({why}); "
                               f"install a C++ compiler, or use kernels='auto' or 'off'")
        return op

    def _step_ops(self):
        """The fused float32 ops of a native eager step (`cpu_kernels.StepOps`), or None."""
        if self.dtype != torch.float32 or self._kernel() is None:
            return None
        return cpu_kernels.step_ops()

    def _native_forward(self) -> NativeForward:
        if self._native is None:
            self._native = NativeForward(self.model, attend_tokens)
        return self._native

    def _native_ready(self) -> bool:
        """Build the native forward in this process (once), bring it up to date with the model,
        and say whether it computes this step (not when hooks it would bypass are registered)."""
        ok = self._native_forward().prepare()
        self._step_impl = "native" if ok else "transformers"
        return ok

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput]) -> ForwardOut:
        """One forward over the batch.

        Args:
            seqs: per request, the tokens to feed (the unseen suffix: whole prompt on
                prefill, one token on decode, a few on extend), the position of the first
                fed token (= tokens already in this model's KV) and the block table, already
                grown to cover ``start + len(tokens)``.

        Returns:
            a `ForwardOut`: logits: last-position logits per request, shape [B, V].
            hidden: last-layer hidden states (after the final norm) at those positions, [B, H].
            fed_hidden: only when an input has ``all_hidden``: per input, the last-layer hidden
                states of every fed position, [len(tokens), H], or None where not asked.
        """
        _configure_sdpa(self.device)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            return self._forward(seqs)

    def _forward(self, seqs: list[SeqInput]):
        want_all = any(getattr(s, "all_hidden", False) for s in seqs)
        if self.cuda_graphs and not want_all:
            out = self.graphs.run(seqs)
            if out is not None:
                self.last_compiled, self.last_impl = False, "cuda_graphs"
                return ForwardOut(*out)
        if self.compile and not self._compile_started:
            self._start_compile()
        cf = self._compiled
        fb, ids, pos, last = self._batch(seqs, pad=cf is not None)
        t0 = time.perf_counter()
        if cf is not None and cf.native and not self._native_ready():
            cf = None  # hooks the native forward would bypass: this step runs transformers eagerly
            fb, ids, pos, last = self._batch(seqs)
        if cf is not None:
            logits, hidden, h = cf(fb, ids, pos, last, self._native.projections if cf.native else None)
            logits, hidden = logits[:len(seqs)], hidden[:len(seqs)]
        elif self.impl == "native" and self._native_ready():
            logits, hidden, h = self._native(fb, ids[0], pos[0], last, want_all, self.between_layers,
                                             self._step_ops())
            h = h[None] if h is not None else None
        else:
            h = self.decoder(input_ids=ids, position_ids=pos, use_cache=False, tr_batch=fb).last_hidden_state
            hidden = h[0, last]
            logits = self.lm_head(hidden)
        self.last_compiled = cf is not None
        self.last_impl = "compiled" if cf is not None else self._step_impl
        if self.device.type == "cuda":  # this stream only: a device-wide sync breaks a peer thread's graph capture
            torch.cuda.current_stream(self.device).synchronize()
        self.last_forward_s = time.perf_counter() - t0
        if not want_all:
            return ForwardOut(logits, hidden)
        fed, start = [], 0
        for s in seqs:
            n = len(s.tokens)
            fed.append(h[0, start:start + n] if s.all_hidden else None)
            start += n
        return ForwardOut(logits, hidden, fed)
