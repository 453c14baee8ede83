"""The torch backend: one packed forward of any `transformers` causal LM over a ragged batch
that mixes prefill, decode and extend, with K/V kept in our own paged `KVPool`.

How: the batch is packed into one [1, T] sequence (T = sum of the fed suffix lengths) with
per-token ``position_ids`` (`tokenrouter_sdk.backends.attention.batch.pack`); the model's
attention is switched to the paged attention (`tokenrouter_sdk.backends.attention`), which writes
the new K/V into the pool slots and attends each request to its own cached prefix with each
layer's parameters (window, soft-cap, scale), read from the model once when the runner is built
(`tokenrouter_sdk.backends.attention.spec`; a feature it cannot compute is refused there). The
native forward (`tokenrouter_sdk.backends.native_forward`) and the transformers one call the same
attention with the same parameters. Only the last position of each request goes through the LM
head (never full-sequence logits), then the model's final-logit soft-cap where it has one.
Outside a runner's steps the switched model runs its own attention, so it still works for
ordinary use (``model(...)``, ``generate``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.config import KERNEL_MODES, MODEL_IMPLS
from ..engine.core.kv_pool import KVPool
from ..engine.runner import ForwardOut, PoolShape, RunnerInfo, SeqInput
from . import cpu_kernels
from .attention import (
    AttentionSpec,
    PadSeq,
    attend_tokens,
    cpu_kernel,
    pack,
    paged_mask,
    read_spec,
    register_attention,
    use_paged_attention,
)
from .attention.kernel_choice import extend_limit, tile_choice
from .native_forward import NativeForward, native_support

KERNEL_WAIT_S = 600.0  # the longest a kernels="wait" step waits for the C++ kernels' build
CACHED_WAIT_S = 10.0  # the longest a kernels="auto" step waits for kernels already built on disk to load


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` as the Gemma causal LMs compute it (in that order), or the
    logits unchanged when ``cap`` is None."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def _configure_sdpa(device: torch.device) -> None:
    """On CUDA, turn the cuDNN SDPA backend off for this process (flash, memory-efficient and
    math kernels stay): cuDNN builds an execution plan for every new query/key shape, and a decode
    step's key length changes every step, so the plans would cost host time at every attention
    call (measured in ``docs/benchmarks.md``, "Runner choices (torch_runner)"). Set once, not
    with the ``sdpa_kernel`` context per call: its flags are process-wide, and two sub-servers
    in threads entering and leaving it would undo each other's setting mid-step."""
    if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)


_SCRATCH_NEED = 4  # scratch slots a compiled runner uses: 3 for the compile's warm-up, 1 for padding


def _compile_mode(compile) -> str | None:
    if compile in (False, None, "off"):
        return None
    if compile is True or compile == "background":
        return "background"
    if compile == "wait":
        return "wait"
    raise ValueError(f"compile must be False, True, 'background' or 'wait', got {compile!r}")


def _check_options(compile, kernels: str, model_impl: str) -> str | None:
    """The compile mode of ``compile`` (`_compile_mode`) after checking ``kernels`` and
    ``model_impl``.

    Raises:
        ValueError: a value none of the accepted ones (names the setting and the choices).
    """
    mode = _compile_mode(compile)
    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {kernels!r}")
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    return mode


def _kv_geometry(cfg) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a model config, as the runner's `KVPool` is shaped."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def _pool_blocks(max_kv_tokens: int, block_size: int, cuda_graphs: bool, compile_mode: str | None) -> tuple[int, int]:
    """(usable blocks, scratch blocks) of a runner's pool: ``max_kv_tokens`` rounded up to whole
    blocks; a scratch block for CUDA-graph padding rows and, compiled, room for the compile's
    warm-up batch and a padding token."""
    scratch = (1 if block_size >= 2 else 2) if cuda_graphs else 0
    if compile_mode:  # the compile's warm-up batch (3 tokens) and a padding token
        scratch = max(scratch, -(-_SCRATCH_NEED // block_size))
    return -(-max_kv_tokens // block_size), scratch


def _read_attention(model, allow_unknown: bool) -> AttentionSpec:
    """Switch ``model`` to the paged attention and read its `AttentionSpec`, warning (a
    `RuntimeWarning`) about the features ``allow_unknown`` lets it run without.

    Raises:
        UnsupportedAttention: a feature the paged attention does not compute, unless ``allow_unknown``.
    """
    use_paged_attention(model)
    spec = read_spec(model, allow_unknown=allow_unknown)
    if spec.ignored:
        warnings.warn(
            f"allow_unknown_attention: {type(model).__name__} runs without: "
            f"{'; '.join(spec.ignored)}; its outputs may differ from the model's",
            RuntimeWarning,
            stacklevel=3,
        )
    return spec


def _native_reason(model, model_impl: str) -> str | None:
    """Why eager steps of ``model`` do not run the native forward (None: they do).

    Raises:
        ValueError: ``model_impl="native"`` for a model with no native forward (says why).
    """
    reason = native_support(model) if model_impl != "transformers" else "model_impl='transformers'"
    if model_impl == "native" and reason is not None:
        raise ValueError(
            f"model_impl='native': no native forward for {type(model).__name__}: {reason}; "
            f"use model_impl='auto' or 'transformers'"
        )
    return reason


class TorchRunner:
    """Runs one model's packed forward over a ragged batch.

    Args:
        model: a `transformers` causal LM (Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3 families, or
            any whose decoder layers call ``ALL_ATTENTION_FUNCTIONS``; see docs/own-models.md).
            Its attention implementation is switched to the paged one, and each layer's
            attention parameters are read from it (`tokenrouter_sdk.backends.attention.spec`).
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
            model on a CPU with float32, float64 or bfloat16 weights: decode and short-extend queries (at
            most `cpu_kernel.MAX_QUERIES` tokens) attend their cached keys in place in the pool,
            with no per-step gather; float32 and bfloat16 native steps also run their norms, rotary
            embedding and SiLU gating as fused ops. ``"auto"`` (default): once built, in the background from
            the first construction in a process (the first build compiles the sources; later
            processes load it from the disk cache), and ATen ops
            (gather + SDPA) until then or where they cannot be built; ``"wait"``: the first step
            waits for them and raises RuntimeError if they cannot be built; ``"off"``: never.
            Outputs agree within floating-point rounding (float64 attention: about 1e-15).
        allow_unknown_attention: run a model whose attention uses a feature the paged attention
            does not compute (an unknown attention keyword, chunked or bidirectional attention,
            a logit transformation after the LM head, a layer that keeps a state of its own),
            computing causal attention with the known parameters, at the user's risk; by default
            such a model is refused.
        attention: the model's `AttentionSpec` when already read (`TorchRunnerSpec.describe`
            reads it where the spec is made): the model is switched to the paged attention but
            not probed again. None: read here.

    Raises:
        UnsupportedAttention: (a ValueError) the model uses an attention feature the paged
            attention does not compute (names the model, the layer and the feature), unless
            ``allow_unknown_attention``.

    On CUDA the first forward turns the cuDNN SDPA backend off for the process (see
    `_configure_sdpa`; ``torch.backends.cuda.enable_cudnn_sdp(True)`` turns it back on).

    Attributes:
        pool: the private `KVPool` (with a scratch block when ``cuda_graphs``).
        spec: the model's `AttentionSpec` (per layer window, soft-cap and scale; the final-logit
            soft-cap), which every forward and attention backend of this runner takes.
        graphs: the `DecodeGraphs`, or None without ``cuda_graphs`` (built on first use, in the
            process that runs the sub-server: graphs do not travel between processes).
        last_forward_s: seconds spent in the last model forward (for overhead metrics).
        impl: the forward eager steps run, ``"native"`` or ``"transformers"``; ``native_reason``:
            why not native (None when native).
        between_layers: None, or a callable the native forward calls between two layers of a
            step (set in a sub-server process for core lending: `tokenrouter_sdk.engine.transports.cores`).
        last_impl: the forward the last step ran: ``"native"``, ``"transformers"`` (also a native
            runner's step while forward hooks the native forward would bypass are registered on
            the model's modules), ``"compiled"`` or ``"cuda_graphs"``.
        last_compiled: whether the last step ran the compiled forward.
        compile_s: seconds the compile took (the first compiled call in this process), or None.
        compile_error: why the compiled forward is off, or None.
    """

    def __init__(
        self,
        model,
        *,
        max_kv_tokens: int = 8192,
        block_size: int = 16,
        cuda_graphs: bool = False,
        max_graph_batch: int = 64,
        compile: bool | str = False,
        model_impl: str = "auto",
        kernels: str = "auto",
        allow_unknown_attention: bool = False,
        attention: AttentionSpec | None = None,
        owns_model: bool = False,
    ):
        self.compile = _check_options(compile, kernels, model_impl)
        self.owns_model = bool(owns_model)
        self.kernels = kernels
        self.model = model
        self.native_reason = _native_reason(model, model_impl)
        self.impl = "native" if self.native_reason is None else "transformers"
        self._native = None  # the NativeForward, built in the process that runs the steps
        self.between_layers = None  # called between two layers of a native step (core lending)
        self._step_impl = self.last_impl = self.impl
        self.allow_unknown_attention = bool(allow_unknown_attention)
        if attention is None:
            self.spec: AttentionSpec = _read_attention(model, self.allow_unknown_attention)
        else:
            use_paged_attention(model)
            self.spec = attention
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        layers, kv_heads, head_dim = _kv_geometry(cfg)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        blocks, scratch = _pool_blocks(max_kv_tokens, block_size, cuda_graphs, self.compile)
        self.pool = KVPool(
            layers, kv_heads, head_dim, blocks, block_size, dtype=self.dtype, device=self.device, scratch_blocks=scratch
        )
        self.cuda_graphs, self.max_graph_batch = bool(cuda_graphs), max_graph_batch
        self._graphs = None
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        self._mask = paged_mask(self.device)
        self.last_forward_s = 0.0
        self.last_compiled = False
        self.compile_error: str | None = None
        self._compiled = None  # the CompiledForward once usable (per process)
        self._compile_thread: threading.Thread | None = None
        self._compile_started = False
        # (queries, source): the longest extend the CPU kernel attends, measured at the first
        # step that has the kernel (`kernel_choice.extend_limit`)
        self.kernel_extend: tuple[int, str] | None = None
        # (queries or 0, source): from how many queries the kernel scores 16 keys at a time
        # (`kernel_choice.tile_choice`), measured before the extend limit
        self.kernel_tiles: tuple[int, str] | None = None
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
        state.pop("kv_blocks", None)  # block ids are allocated where the runner serves
        state.pop("_waited_for_cached", None)  # the kernels load per process
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
                self.compile_error = (
                    "the native forward has a projection module of unknown width (a wrapper "
                    "without out_features): steps stay eager"
                )
                warnings.warn(f"compile: {self.compile_error}", RuntimeWarning, stacklevel=3)
                return
        cf = compiled_forward(self.model, self.decoder, self.lm_head, freezing=sizes is None, sizes=sizes)
        if cf.ready.is_set():  # compiled by another runner of this model in this process
            self._compiled = cf
            return
        if self.compile == "wait":
            self._warm_up(cf)
            return
        self._compile_thread = threading.Thread(
            target=self._warm_up, args=(cf,), daemon=True, name="tokenrouter-compile"
        )
        self._compile_thread.start()

    @torch.inference_mode()  # as the steps run: inference tensors (dynamo guards on it)
    def _warm_up(self, cf) -> None:
        pool = self.pool
        if pool is None or pool.k is None:
            return
        s = pool.scratch_slot
        # two prefills (2 tokens and 1) in scratch slots: T=3 and B=2, so that dynamo relates no sizes
        fb, ids, pos, last = pack([PadSeq([s, s + 1]), PadSeq([s + 2])], pool, self.spec, self.device)
        batch = (fb, ids, pos, last, self._native.projections if cf.native else None)
        if cf.warm_up(batch):
            self._compiled = cf
        else:
            self.compile_error = cf.error
            warnings.warn(
                f"torch.compile of the model forward failed, steps stay eager: {cf.error}", RuntimeWarning, stacklevel=2
            )

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

    def _batch(self, seqs: list[SeqInput], pad: bool = False):
        """The step's `ForwardBatch`, token ids [1, T], positions [1, T] and each request's last
        packed index [B] (`tokenrouter_sdk.backends.attention.batch.pack`). ``pad``: a batch of one
        request gets a second, one-token request that writes and reads only a scratch slot
        (compiled steps need T, B >= 2; its row is dropped)."""
        if pad and len(seqs) == 1:
            seqs = [*seqs, PadSeq([self.pool.scratch_slot + _SCRATCH_NEED - 1])]
        op = self._kernel()
        return pack(
            seqs,
            self.pool,
            self.spec,
            self.device,
            None if op is None else cpu_kernel.CpuKernel(op, self._extend_limit(op), self._tile_from(op)),
        )

    def _extend_limit(self, op) -> int:
        """The longest extend (tokens) the kernel ``op`` attends for this model on this machine
        (measured once per machine and shape, then read from the choices file)."""
        if op is None:
            return cpu_kernel.MAX_QUERIES
        if self.kernel_extend is None:
            k = self.pool.k
            self.kernel_extend = extend_limit(
                op,
                int(self.model.config.num_attention_heads),
                int(k.shape[-2]),
                int(k.shape[-1]),
                self.dtype,
                int(k.shape[0]),
                tile_from=self._tile_from(op),
            )
        return self.kernel_extend[0]

    def _tile_from(self, op) -> int:
        """From how many queries the kernel ``op`` scores a request 16 keys at a time for this
        model on this machine (0: never; measured once per machine and shape)."""
        if self.kernel_tiles is None:
            k = self.pool.k
            self.kernel_tiles = tile_choice(
                op,
                int(self.model.config.num_attention_heads),
                int(k.shape[-2]),
                int(k.shape[-1]),
                self.dtype,
                int(k.shape[0]),
            )
        return self.kernel_tiles[0]

    def _kernels_apply(self) -> bool:
        return self.kernels != "off" and self.device.type == "cpu" and self.dtype in cpu_kernels.DTYPES

    def _kernel(self):
        """The in-place paged attention op for this step, or None (gather and SDPA): see the
        ``kernels`` argument."""
        if not self._kernels_apply():
            return None
        if self.kernels == "wait":
            op = cpu_kernels.paged_attention_op(wait=True, timeout=KERNEL_WAIT_S)
        else:
            op = cpu_kernels.paged_attention_op()
            if op is None and not self.__dict__.get("_waited_for_cached"):
                # a library already built on disk loads in under a second: the first step waits for it,
                # so steps do not change path (and the projections their weights) while serving
                self._waited_for_cached = True
                if cpu_kernels.cached():
                    op = cpu_kernels.paged_attention_op(wait=True, timeout=CACHED_WAIT_S)
        if op is None and self.kernels == "wait":
            why = cpu_kernels.error() or f"still building after {KERNEL_WAIT_S:.0f} s"
            raise RuntimeError(
                f"kernels='wait': the C++ CPU kernels could not be built ({why}); "
                f"install a C++ compiler, or use kernels='auto' or 'off'"
            )
        return op

    def _step_ops(self):
        """The fused float32 or bfloat16 ops of a native eager step (`cpu_kernels.StepOps`), or None."""
        if self.dtype not in cpu_kernels.STEP_DTYPES or self._kernel() is None:
            return None
        return cpu_kernels.step_ops()

    def _native_forward(self) -> NativeForward:
        if self._native is None:
            release = (
                self.owns_model
                and self.device.type == "cpu"
                and self.dtype != torch.float32
                and not self.compile
                and not self.cuda_graphs
            )
            self._native = NativeForward(self.model, attend_tokens, release=release)
        return self._native

    @torch.inference_mode()
    def prepare_steps(self) -> None:
        """Make what the first step would make, before any request: load the C++ kernels when
        they are built already, build the native forward's projections (oneDNN packing, the
        measured GEMM choices) and, with the kernels, the few-row kernel's weights. A runner
        built from its spec does this where its sub-server starts, so no request waits for it."""
        if self.impl != "native" or self.pool is None or self.pool.k is None:
            return
        self._kernel()
        if self._native_ready():
            nf = self._native
            if self._step_ops() is not None and not nf._skinny_tuned:
                nf.add_skinny()

    @property
    def plain_released(self) -> int:
        """Bytes of the model's own projection weights freed (`release_plain_weights`); 0: none,
        the model is whole."""
        return self._native.released_bytes if self._native is not None else 0

    def release_plain_weights(self) -> int:
        """For a model this runner alone reads (``owns_model``: its spec loaded it from a folder
        in this process): free the model's own copy of every projection weight that has a packed
        copy, so the process holds its weights once (`NativeForward.release_plain`). A bfloat16
        or float16 model on a CPU has them freed as each projection is packed (its peak is then
        about its weights once); a float32 one here, once the few-row kernel's weights (made from
        the model's own) exist. Does nothing (returns 0) unless the native forward runs on a
        CPU, uncompiled. Returns the bytes freed. The transformers forward can no longer run this
        model afterwards."""
        if (
            not self.owns_model
            or self.impl != "native"
            or self.device.type != "cpu"
            or self.compile
            or self.cuda_graphs
            or self.pool is None
            or self.pool.k is None
            or not self._native_ready()
        ):
            return 0
        nf = self._native
        if self.dtype == torch.float32 and self._step_ops() is not None and not nf._skinny_tuned:
            nf.add_skinny()
        if self.dtype == torch.float32 and not nf._skinny_tuned and self.kernels != "off":
            return 0  # the kernels come later and make their weights from the model's own
        return nf.release_plain()

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
                logits, hidden = out
                return ForwardOut(softcap_logits(logits, self.spec.final_softcap), hidden)
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
            logits, hidden = logits[: len(seqs)], hidden[: len(seqs)]
        elif self.impl == "native" and self._native_ready():
            logits, hidden, h = self._native(fb, ids[0], pos[0], last, want_all, self.between_layers, self._step_ops())
            h = h[None] if h is not None else None
        else:
            h = self.decoder(
                input_ids=ids, position_ids=pos, attention_mask=self._mask, use_cache=False, tr_batch=fb
            ).last_hidden_state
            hidden = h[0, last]
            logits = self.lm_head(hidden)
        logits = softcap_logits(logits, self.spec.final_softcap)
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
            fed.append(h[0, start : start + n] if s.all_hidden else None)
            start += n
        return ForwardOut(logits, hidden, fed)


def _is_source(model) -> bool:
    """Whether ``model`` names a checkpoint folder (a path) rather than being a loaded model."""
    return isinstance(model, (str, os.PathLike))


@dataclass
class TorchRunnerSpec:
    """The recipe of a `TorchRunner` (a `tokenrouter_sdk.engine.runner.RunnerSpec`): picklable,
    shipped to the process that serves the model, where `build` makes the runner and its KV
    pool. A loaded model travels as itself (a process transport maps its weights from shared
    memory, `tokenrouter_sdk.engine.transports.wire.pack_shared`); a folder is loaded where `build` runs.

    Args:
        model: a loaded `transformers` causal LM, or a checkpoint folder with ``config.json``
            (`tokenrouter_sdk.models.load_model` loads it in `build`).
        max_kv_tokens: KV capacity in tokens, as for `TorchRunner`.
        block_size: tokens per KV block, as for `TorchRunner`.
        cuda_graphs: as for `TorchRunner`.
        max_graph_batch: as for `TorchRunner`.
        compile: as for `TorchRunner`.
        model_impl: as for `TorchRunner`.
        kernels: as for `TorchRunner`.
        allow_unknown_attention: as for `TorchRunner`.
        dtype: a folder's precision (``"auto"``: its ``config.json``'s; a name or a torch dtype).
            For a loaded model: its weights' dtype (filled in; a different one raises).
        device: where a folder loads (default ``"cpu"``). For a loaded model: its weights'
            device (filled in; a different one raises).
        attention: the model's `AttentionSpec`, read by `describe` (for a loaded model) so that
            `build` does not probe the model again. None: not read yet.

    Raises:
        ValueError: a bad ``compile``, ``kernels`` or ``model_impl`` (names it); a ``dtype`` or
            ``device`` that differs from a loaded model's own.
    """

    model: Any
    max_kv_tokens: int = 8192
    block_size: int = 16
    cuda_graphs: bool = False
    max_graph_batch: int = 64
    compile: bool | str = False
    model_impl: str = "auto"
    kernels: str = "auto"
    allow_unknown_attention: bool = False
    dtype: Any = None
    device: Any = None
    attention: AttentionSpec | None = None

    def __post_init__(self):
        _check_options(self.compile, self.kernels, self.model_impl)
        if _is_source(self.model):
            self.model = os.fspath(self.model)
            self.device = torch.device(self.device if self.device is not None else "cpu")
            return
        p = next(self.model.parameters())
        if self.device is not None and torch.device(self.device) != p.device:
            raise ValueError(f"TorchRunnerSpec: device={self.device!r}, but the model is on {p.device}")
        if self.dtype is not None:
            from ..placement import AUTO, resolve_dtype

            want = resolve_dtype(self.dtype)
            if want != AUTO and want != p.dtype:
                raise ValueError(f"TorchRunnerSpec: dtype={self.dtype!r}, but the model is in {p.dtype}")
        self.device, self.dtype = p.device, p.dtype

    def __repr__(self) -> str:
        src = self.model if _is_source(self.model) else type(self.model).__name__
        return (
            f"TorchRunnerSpec({src}, device={self.device}, dtype={self.dtype}, max_kv_tokens={self.max_kv_tokens}, "
            f"block_size={self.block_size})"
        )

    def _config(self):
        if not _is_source(self.model):
            return self.model.config
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model)

    def _folder_dtype(self, cfg) -> torch.dtype:
        from ..placement import AUTO, resolve_dtype

        want = resolve_dtype(self.dtype if self.dtype is not None else AUTO)
        if isinstance(want, torch.dtype):
            return want
        have = getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None)
        return resolve_dtype(have) if have is not None else torch.float32

    def describe(self) -> RunnerInfo:
        """What the built runner will be, without allocating its pool: vocabulary size (the LM
        head's rows; a folder's ``config.vocab_size``), max context (``max_position_embeddings``),
        device, dtype and pool shape (blocks, block size, scratch blocks); ``extra`` holds
        ``impl``, ``native_reason``, ``compile`` (the mode), ``kernels`` and ``spec`` (the
        `AttentionSpec`) as the runner will have them (for a folder only ``compile`` and
        ``kernels``: the model is checked where it loads). For a loaded model this switches it
        to the paged attention and reads its `AttentionSpec` once (kept in ``attention``).

        Raises:
            UnsupportedAttention: the model uses an attention feature the paged attention does
                not compute, unless ``allow_unknown_attention``.
            ValueError: ``model_impl="native"`` for a model with no native forward.
        """
        mode = _compile_mode(self.compile)
        cfg = self._config()
        blocks, scratch = _pool_blocks(self.max_kv_tokens, self.block_size, self.cuda_graphs, mode)
        pool = PoolShape(blocks, self.block_size, scratch)
        max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        extra: dict[str, Any] = {"compile": mode, "kernels": self.kernels}
        if _is_source(self.model):
            return RunnerInfo(int(cfg.vocab_size), max_context, self.device, self._folder_dtype(cfg), pool, extra)
        reason = _native_reason(self.model, self.model_impl)
        if self.attention is None:
            self.attention = _read_attention(self.model, bool(self.allow_unknown_attention))
        extra.update(impl="native" if reason is None else "transformers", native_reason=reason, spec=self.attention)
        vocab = int(self.model.get_output_embeddings().weight.shape[0])
        return RunnerInfo(vocab, max_context, self.device, self.dtype, pool, extra)

    def prefetch(self) -> None:
        """Start, in this process, what the runner needs that is cached on disk: the build of
        the CPU kernels (`cpu_kernels.start`, in a background thread) when they apply. A runner
        built elsewhere from this spec then loads the cached library instead of compiling it
        while its first requests run."""
        dtype = self.dtype if isinstance(self.dtype, torch.dtype) else None  # a folder's: known once loaded
        if self.kernels != "off" and self.device.type == "cpu" and (dtype is None or dtype in cpu_kernels.DTYPES):
            cpu_kernels.start()

    def build(self) -> TorchRunner:
        """The `TorchRunner`, with its KV pool allocated here (a folder is loaded here first).

        Raises:
            Exception: what `TorchRunner` or `tokenrouter_sdk.models.load_model` raises (e.g.
                `ValueError` for a bad option, `UnsupportedAttention`, out of memory for the pool).
        """
        model, attention = self.model, self.attention
        owned = _is_source(model)
        if owned:
            from ..models import load_private

            model = load_private(model, dtype=self.dtype if self.dtype is not None else "auto", device=str(self.device))
        runner = TorchRunner(
            model,
            max_kv_tokens=self.max_kv_tokens,
            block_size=self.block_size,
            cuda_graphs=self.cuda_graphs,
            max_graph_batch=self.max_graph_batch,
            compile=self.compile,
            model_impl=self.model_impl,
            kernels=self.kernels,
            allow_unknown_attention=self.allow_unknown_attention,
            attention=attention,
            owns_model=owned,
        )
        runner.prepare_steps()
        if owned:  # no one else reads this model: its weights once, packed
            runner.release_plain_weights()
        return runner
