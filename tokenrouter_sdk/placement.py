"""Where a model runs and in what precision: `ModelSpec` (a source with its own device and dtype),
and the checks that turn a device or dtype given as text into a torch one, or into an error that
names the fix (e.g. the command that installs a CUDA build of torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}
AUTO = "auto"
RUNNERS = ("torch", "vllm", "sglang")  # who runs a model's forward (`ModelSpec.runner`)
CUDA_WHEELS = "https://download.pytorch.org/whl/cu128"


class DeviceError(ValueError):
    """A device that cannot be used here: not a device name, a CUDA device on a CPU-only build
    of torch, no such device index, or no visible accelerator (the message names the fix)."""


def cuda_install_command() -> str:
    """The command that replaces this torch by a CUDA build of the same version."""
    version = torch.__version__.split("+")[0]
    return f"pip install --force-reinstall 'torch=={version}' --index-url {CUDA_WHEELS}"


def resolve_dtype(dtype) -> torch.dtype | str | None:
    """A torch dtype, ``"auto"`` (the checkpoint's own dtype) or None (not given) from a dtype
    given as a torch dtype or a name: ``"bfloat16"``/``"bf16"``, ``"float16"``/``"fp16"``/``"half"``,
    ``"float32"``/``"fp32"``, ``"float64"``, ``"auto"`` (also ``"torch.bfloat16"``).

    Raises:
        ValueError: an unknown name or a dtype that is not floating point (lists the names).
    """
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key == AUTO:
            return AUTO
        if key in DTYPES:
            return DTYPES[key]
    raise ValueError(
        f"dtype {dtype!r} is not a floating-point dtype; give 'auto' (the checkpoint's own), "
        f"'bfloat16', 'float16', 'float32' or 'float64' (or a torch dtype)"
    )


def resolve_device(device) -> torch.device:
    """``device`` (a string such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, or a
    `torch.device`) as a `torch.device` that exists on this machine (``"cuda"`` becomes the
    current CUDA device with its index).

    Raises:
        DeviceError: not a device name; a CUDA device with a CPU-only build of torch (names the
            command that installs a CUDA build); no CUDA device visible; an index beyond the
            devices there are (lists them); MPS or another accelerator not available.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(
            f"device {device!r} is not a device name; give e.g. 'cpu', 'cuda', 'cuda:1' or 'mps' ({e})"
        ) from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise DeviceError(
                f"device {str(dev)!r}: this torch ({torch.__version__}) is a CPU-only build, it cannot "
                f"use a GPU. Install a CUDA build of the same version: {cuda_install_command()} "
                f"(pick the CUDA version your driver supports: https://pytorch.org/get-started/locally/)"
            )
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device {str(dev)!r}: torch {torch.__version__} was built with CUDA but sees no CUDA "
                f"device (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them); check nvidia-smi, "
                f"or use device='cpu'"
            )
        n = torch.cuda.device_count()
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if not 0 <= index < n:
            have = ", ".join(f"cuda:{i}" for i in range(n))
            raise DeviceError(
                f"device {str(dev)!r} does not exist: this machine has {n} CUDA device{'s' * (n != 1)} ({have})"
            )
        return torch.device("cuda", index)
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise DeviceError(
                f"device {str(dev)!r}: MPS is not available here (it needs Apple silicon and a torch "
                f"built with MPS); use device='cpu'"
            )
        return dev
    backend = getattr(torch, dev.type, None)
    if backend is not None and hasattr(backend, "is_available") and not backend.is_available():
        raise DeviceError(f"device {str(dev)!r}: no {dev.type} device is available to this torch ({torch.__version__})")
    return dev


@dataclass(frozen=True)
class ModelSpec:
    """One model of a `Router` given by its source, with its own placement and precision.

    ``Router({"small": ModelSpec("Qwen/Qwen3-0.6B", device="cuda:0"),
    "large": ModelSpec("Qwen/Qwen3-8B", device="cuda:1", dtype="bfloat16")}, policy)``; a dict
    with the same keys (``{"source": ..., "device": ..., "dtype": ...}``) works too.

    Attributes:
        source: a local folder (with ``config.json``), a ``.gguf`` file or a hub id
            (`tokenrouter_sdk.models.load_model`).
        device: where it runs (``"cpu"``, ``"cuda:1"``, ...); None: the Router's ``device``
            (``"cpu"`` by default).
        dtype: its precision: ``"auto"`` (the checkpoint's own, from its ``config.json``; float32
            for GGUF files, which are dequantized), a name (``"bfloat16"``) or a torch dtype;
            None: the Router's ``dtype`` (``"auto"`` by default).
        gguf_file: the GGUF file's name inside a folder holding several.
        tp: tensor-parallel ranks of this model (`tokenrouter_sdk.backends.tensor_parallel`): its
            sub-server's runner is rank 0 of ``tp`` processes, each holding ``1/tp`` of the
            attention heads, KV heads and MLP width (all must divide by ``tp``); on CUDA rank r
            uses ``cuda:r``. None: the Router's ``tp`` for this model (1 by default).
        runner: who runs its forward: ``"torch"`` (default: our torch runner,
            `tokenrouter_sdk.backends.torch_runner`), ``"vllm"`` (vLLM's model classes, weight
            loader, attention kernels and paged KV: `tokenrouter_sdk.backends.vllm_runner`; needs
            ``pip install 'tokenrouter-sdk[vllm]'``) or ``"sglang"`` (SGLang's:
            `tokenrouter_sdk.backends.sglang_runner`). Scheduling, handoffs, KV retention and the
            policy are the engine's whichever runs the forward; a pair may mix runners. See
            docs/own-models.md for which to choose.
        engine_args: further settings of the ``"vllm"`` or ``"sglang"`` runner's engine config
            (e.g. ``{"quantization": "awq"}``); empty for ``"torch"``.

    ``source`` may also be a loaded model (a ``transformers`` causal LM, or ``(model, tokenizer)``)
    to give it a ``tp``: ``ModelSpec(model, tp=2)``.
    """

    source: Any
    device: Any = None
    dtype: Any = None
    gguf_file: str | None = None
    tp: int | None = None
    runner: str = "torch"
    engine_args: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.runner not in RUNNERS:
            raise ValueError(f"ModelSpec.runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.engine_args and self.runner == "torch":
            raise ValueError(
                "ModelSpec.engine_args configures the 'vllm' or 'sglang' runner's engine; "
                "the torch runner takes none (set runner='vllm' or drop engine_args)"
            )

    @classmethod
    def of(cls, value) -> "ModelSpec | None":
        """``value`` as a `ModelSpec` when it names a source: a `ModelSpec`, a source string or
        path, or a dict with ``source`` (and optionally ``device``, ``dtype``, ``gguf_file``,
        ``tp``, ``runner``, ``engine_args``);
        None for anything else (a loaded model, a runner, a ``(model, tokenizer)`` pair).

        Raises:
            TypeError: a dict without ``source`` or with other keys (names them).
        """
        if isinstance(value, ModelSpec):
            return value
        if isinstance(value, (str, bytes)) or isinstance(value, os.PathLike):
            return cls(value)
        if isinstance(value, Mapping):
            keys = set(value)
            unknown = sorted(keys - {"source", "device", "dtype", "gguf_file", "tp", "runner", "engine_args"})
            if "source" not in keys or unknown:
                raise TypeError(
                    f"a model given as a dict takes 'source' (folder, GGUF file or hub id) and optionally "
                    f"'device', 'dtype', 'gguf_file', 'tp', 'runner', 'engine_args'; got keys "
                    f"{sorted(keys)}"
                )
            return cls(**value)
        return None

    @property
    def loaded(self) -> bool:
        """Whether ``source`` is a model object (or ``(model, tokenizer)``), not a place to load from."""
        return isinstance(self.source, (torch.nn.Module, tuple))

    def placed(self, device=None, dtype=None) -> tuple[torch.device, torch.dtype | str]:
        """``(device, dtype)`` this model loads with: its own, else the given defaults, else
        ``"cpu"`` and ``"auto"``; checked (`resolve_device`, `resolve_dtype`).

        Raises:
            DeviceError: the device cannot be used here.
            ValueError: an unknown dtype.
        """
        dev = self.device if self.device is not None else device if device is not None else "cpu"
        dt = resolve_dtype(self.dtype) if self.dtype is not None else resolve_dtype(dtype)
        return resolve_device(dev), AUTO if dt is None else dt
