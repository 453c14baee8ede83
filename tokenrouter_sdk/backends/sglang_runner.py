"""SGLang's model runner behind our runner seam, the way `tokenrouter_sdk.backends.vllm_runner`
puts vLLM's there: SGLang's `ModelRunner` loads the model (its model classes and weight loader),
allocates its token-to-KV pool with pages of our block size, and runs each step with its
attention backend (FlashInfer, Triton, FlashAttention, as SGLang picks on the device); the
schedule, handoffs, KV retention and routing stay ours.

Our block ids become SGLang's KV locations: a token at position p of a request lives at location
``(table[p // block_size] + 1) * block_size + p % block_size`` (SGLang keeps page 0 of its pool
as the padding page its CUDA-graph padding writes to, so our block b is its page b + 1). Each
step writes every request's locations into a row of SGLang's ``req_to_token`` table (row 0 is
its padding row: requests take rows 1..B), builds the `ForwardBatch` of an EXTEND step (a
decode is an extend of one token) from a minimal batch view, and reads the last positions'
logits (the model's own logits processor) and the captured hidden states.

Written against SGLang 0.5.23 (``pip install 'sglang==0.5.23'``: torch 2.14.1 and CUDA kernels)
for a GPU. On a CPU it refuses to build: SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) needs
``sgl_kernel`` built for the CPU from source, and the wheel on the package registry
(``sglang-kernel``) is CUDA-only (loading it on a machine without CUDA fails with ``libcuda.so.1:
cannot open shared object file``); without the CPU engine, its models take their rotary
embedding from ``vllm._custom_ops``, which cannot be installed beside it (vLLM pins another
torch). The tier tests/engines/test_sglang_runner.py runs it where SGLang and a GPU are present.

Nothing here imports SGLang at import time.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from ..engine.runner import ForwardOut, PoolShape, RunnerInfo, SeqInput
from .vllm_runner import VLLMUnsupported, _checkpoint_dtype, _dtype_name

EXTRA_HINT = "pip install 'sglang==0.5.23' (on a CUDA machine; it brings torch 2.14.1 and SGLang's CUDA kernels)"
CPU_REASON = (
    "SGLang runs a model on a CPU only with its CPU kernels (sgl_kernel built from source for the CPU, "
    "SGLANG_USE_CPU_ENGINE=1); the sglang-kernel wheel is CUDA-only. Use runner='vllm' or 'torch' on a CPU"
)

# SGLang keeps its published server config, parallel state and forward context per process
_STEP_LOCK = threading.RLock()


def sglang_missing(device: torch.device) -> str | None:
    """Why the SGLang runner cannot be used here for ``device`` (None: it can)."""
    if importlib.util.find_spec("sglang") is None:
        return f"runner='sglang' needs SGLang, which is not installed: {EXTRA_HINT}"
    if device.type != "cuda":
        return f"runner='sglang' on {device}: {CPU_REASON}"
    return None


class _BatchView(SimpleNamespace):
    """The fields of SGLang's ``ScheduleBatch`` that ``ForwardBatch.init_new`` reads for a plain
    extend step; every other field reads as None (no LoRA, speculation, multimodal input,
    grammar, Mamba state or data parallelism)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


@dataclass
class SGLangRunnerSpec:
    """The recipe of an `SGLangRunner` (a `tokenrouter_sdk.engine.runner.RunnerSpec`).

    Args:
        source: a checkpoint folder or hub id SGLang loads.
        max_kv_tokens: KV capacity in tokens (rounded up to whole blocks).
        block_size: tokens per KV block (SGLang's ``page_size``).
        dtype: ``"auto"`` / None (the checkpoint's), a name or a torch dtype.
        device: a CUDA device (default ``"cuda"``; a CPU is refused, see the module docstring).
        engine_args: further ``sglang.srt.server_args.ServerArgs`` fields (e.g.
            ``{"attention_backend": "triton", "quantization": "fp8"}``).

    Raises:
        ValueError: ``engine_args`` naming a field this runner sets.
    """

    source: Any
    max_kv_tokens: int = 8192
    block_size: int = 16
    dtype: Any = None
    device: Any = None
    engine_args: dict = field(default_factory=dict)

    _OWN_ARGS = ("model_path", "dtype", "page_size", "max_total_tokens", "skip_tokenizer_init", "disable_radix_cache")

    def __post_init__(self):
        if isinstance(self.source, os.PathLike) or (
            isinstance(self.source, str) and os.path.exists(os.path.expanduser(self.source))
        ):
            self.source = os.path.expanduser(os.fspath(self.source))
        self.device = torch.device(self.device if self.device is not None else "cuda")
        bad = sorted(set(self.engine_args) & set(self._OWN_ARGS))
        if bad:
            raise ValueError(f"runner='sglang': engine_args may not set {bad}: the runner sets them")

    def _config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.source)

    def dtype_of(self, cfg=None) -> torch.dtype:
        """The weights' dtype the built runner will have."""
        from ..placement import AUTO, resolve_dtype

        want = resolve_dtype(self.dtype if self.dtype is not None else AUTO)
        return want if isinstance(want, torch.dtype) else _checkpoint_dtype(cfg or self._config())

    def kv_bytes_per_token(self, cfg=None) -> int:
        """KV bytes per token: 2 * layers * KV heads * head dim * dtype bytes."""
        cfg = cfg or self._config()
        text = getattr(cfg, "text_config", None) or cfg
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return 2 * text.num_hidden_layers * kv_heads * head_dim * self.dtype_of(cfg).itemsize

    def weights_bytes(self) -> int:
        """Bytes of the checkpoint's weight files (0 for a hub id)."""
        if not os.path.isdir(self.source):
            return 0
        return sum(
            e.stat().st_size
            for e in os.scandir(self.source)
            if e.is_file() and e.name.endswith((".safetensors", ".bin", ".pt", ".gguf"))
        )

    def describe(self) -> RunnerInfo:
        """What the built runner will be (see `VLLMRunnerSpec.describe`).

        Raises:
            RuntimeError: SGLang is not installed, or the device is not a GPU (says why).
        """
        missing = sglang_missing(self.device)
        if missing:
            raise RuntimeError(missing)
        cfg = self._config()
        text = getattr(cfg, "text_config", None) or cfg
        max_context = int(self.engine_args.get("context_length") or getattr(text, "max_position_embeddings", 1 << 30))
        pool = PoolShape(-(-int(self.max_kv_tokens) // self.block_size), self.block_size, 1)
        return RunnerInfo(int(text.vocab_size), max_context, self.device, self.dtype_of(cfg), pool, {"impl": "sglang"})

    def build(self) -> "SGLangRunner":
        """The `SGLangRunner`, warmed up by one step on the scratch block.

        Raises:
            RuntimeError: as `describe`.
            Exception: what SGLang raises loading the model.
        """
        missing = sglang_missing(self.device)
        if missing:
            raise RuntimeError(missing)
        runner = SGLangRunner(self)
        runner.prepare_steps()
        return runner


class SGLangRunner:
    """One model's step by SGLang's `ModelRunner` at our block ids (see the module docstring).

    Attributes:
        pool: a `PoolShape` of the usable blocks (SGLang's pool holds the storage, one page
            more for its padding page and one for our scratch block).
        vocab_size, max_context, device, dtype: as for every runner.
        model_runner: SGLang's ``ModelRunner``.
        impl, last_impl: ``"sglang"``; last_forward_s: seconds of the last forward.
    """

    impl = last_impl = "sglang"

    def __init__(self, spec: SGLangRunnerSpec):
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import PortArgs, ServerArgs

        self.spec, self.device, self.last_forward_s = spec, spec.device, 0.0
        bs = spec.block_size
        num_blocks = -(-int(spec.max_kv_tokens) // bs)
        gpu = spec.device.index if spec.device.index is not None else torch.cuda.current_device()
        args = dict(
            model_path=spec.source,
            dtype=_dtype_name(spec.dtype_of()),
            page_size=bs,
            max_total_tokens=(num_blocks + 1) * bs,
            skip_tokenizer_init=True,
            disable_radix_cache=True,
            disable_cuda_graph=True,
            base_gpu_id=gpu,
        )
        args.update(spec.engine_args)
        with _STEP_LOCK:
            torch.cuda.set_device(gpu)
            server_args = ServerArgs(**args)
            server_args.resolve_once()
            publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=gpu))
            self._init_process_configs()
            port_args = PortArgs.init_new(server_args)  # free ports picked by SGLang, none fixed
            model_config = ModelConfig.from_server_args(server_args)
            bootstrap.init_parallel_runtime(server_args=server_args, device="cuda", dist_port=port_args.nccl_port)
            bootstrap.init_layer_runtime(model_config=model_config)
            mr = ModelRunner(
                model_config=model_config,
                mem_fraction_static=server_args.mem_fraction_static,
                gpu_id=gpu,
                nccl_port=port_args.nccl_port,
                server_args=server_args,
            )
            mr.alloc_memory_pool()
            mr.init_attention_backends()
        if mr.max_total_num_tokens < (num_blocks + 1) * bs:
            raise VLLMUnsupported(
                f"runner='sglang': SGLang's KV pool holds {mr.max_total_num_tokens} tokens, fewer "
                f"than the {(num_blocks + 1) * bs} asked: raise mem_fraction_static in engine_args "
                f"or lower max_kv_tokens"
            )
        self.model_runner, self.server_args = mr, server_args
        self.dtype = mr.dtype
        self.max_context = int(model_config.context_len)
        self.vocab_size = int(model_config.vocab_size)
        self.hidden_size = int(model_config.hidden_size)
        self.pool = PoolShape(num_blocks, bs, 1)

    @staticmethod
    def _init_process_configs() -> None:
        """SGLang's process-global GEMM and MoE settings, as its own entry points make them."""
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
        from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config

        initialize_moe_config()
        initialize_fp8_gemm_config()
        initialize_bf16_gemm_config()
        initialize_fp4_gemm_config()

    def release(self) -> None:
        """Drop SGLang's model runner and its KV pool."""
        self.model_runner = None

    @torch.inference_mode()
    def prepare_steps(self) -> None:
        """One step on the scratch block before any request (SGLang's lazy set-up happens here)."""
        out = self.forward([SeqInput([0, 1], 0, [self.pool.num_blocks], all_hidden=True)])
        if out.fed_hidden[0].shape != (2, self.hidden_size):
            raise VLLMUnsupported(
                f"runner='sglang': the model's captured hidden states have shape "
                f"{tuple(out.fed_hidden[0].shape)}, not [tokens, {self.hidden_size}]"
            )

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput]) -> ForwardOut:
        """One step over the batch (see `tokenrouter_sdk.engine.runner.Runner.forward`)."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        if self.model_runner is None:
            raise RuntimeError("this SGLangRunner was released: it serves no step")
        mr, bs, dev = self.model_runner, self.spec.block_size, self.device
        ids, locs, seq_lens, prefix, extend, reqs = [], [], [], [], [], []
        for i, s in enumerate(seqs):
            end = s.start + len(s.tokens)
            if not s.tokens or len(s.table) * bs < end:
                raise ValueError(
                    f"a step input feeds {len(s.tokens)} tokens at position {s.start} with a table of "
                    f"{len(s.table)} blocks of {bs}: it must feed tokens and cover them"
                )
            row = [(s.table[p // bs] + 1) * bs + p % bs for p in range(end)]
            mr.req_to_token_pool.req_to_token[i + 1, :end] = torch.tensor(row, dtype=torch.int32, device=dev)
            ids += s.tokens
            locs += row[s.start :]
            seq_lens.append(end)
            prefix.append(s.start)
            extend.append(len(s.tokens))
            reqs.append(
                SimpleNamespace(
                    rid=str(i),
                    lora_id=None,
                    extend_end=end,
                    full_untruncated_fill_ids=range(end),
                    grammar=None,
                    bootstrap_room=None,
                )
            )
        want_all = any(s.all_hidden for s in seqs)
        seq_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        batch = _BatchView(
            forward_mode=ForwardMode.EXTEND,
            reqs=reqs,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            req_pool_indices=torch.arange(1, len(seqs) + 1, dtype=torch.int64, device=dev),
            req_pool_indices_cpu=torch.arange(1, len(seqs) + 1, dtype=torch.int64),
            seq_lens=seq_cpu.to(dev),
            seq_lens_cpu=seq_cpu,
            seq_lens_sum=int(seq_cpu.sum()),
            orig_seq_lens=seq_cpu.to(dev, torch.int32),
            max_seq_len_host=int(seq_cpu.max()),
            out_cache_loc=torch.tensor(locs, dtype=torch.int64, device=dev),
            extend_lens=extend,
            prefix_lens=prefix,
            extend_logprob_start_lens=extend,
            extend_num_tokens=len(ids),
            return_logprob=False,
            is_extend_in_batch=True,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            has_grammar=False,
            decoding_reqs=[],
            return_hidden_states_mode=CaptureHiddenMode.NULL,
        )
        mode = CaptureHiddenMode.FULL if want_all else CaptureHiddenMode.LAST
        with _STEP_LOCK:
            t0 = time.perf_counter()
            fb = ForwardBatch.init_new(batch, mr, capture_hidden_mode=mode, return_hidden_states_before_norm=False)
            out = mr.forward(fb).logits_output
            torch.cuda.current_stream(dev).synchronize()
            self.last_forward_s = time.perf_counter() - t0
        logits, h = out.next_token_logits[:, : self.vocab_size], out.hidden_states
        last = torch.tensor([sum(extend[: i + 1]) - 1 for i in range(len(seqs))], device=dev)
        hidden = h[last] if want_all else h
        if not want_all:
            return ForwardOut(logits, hidden)
        fed, at = [], 0
        for s in seqs:
            fed.append(h[at : at + len(s.tokens)] if s.all_hidden else None)
            at += len(s.tokens)
        return ForwardOut(logits, hidden, fed)
