"""Models a Router loads where they run, not where it is built.

A model given by a local checkpoint folder (``Router({"large": "path/to/folder"})`` or a
`tokenrouter_sdk.placement.ModelSpec` of one) is loaded by its sub-server, in the sub-server's
process: the Router's own process reads only its config, tokenizer and file sizes
(`DeferredModel`), so a pair of real models costs their weights once, in the processes that
compute with them. `LazyModels` is what ``Router.models`` then holds: the model names in order,
each model loaded in this process only when code here asks for it (training, the delayed-batching
planner's profile, the naive reference), taken from an in-process runner where there is one
(threads transport) instead of loading it twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch


class DeferredModel:
    """A checkpoint folder that will be loaded where it runs.

    Attributes:
        folder: the folder (with ``config.json``).
        config: its transformers config.
        dtype: the precision it loads in.
        device: where it loads.
        nbytes: its weights' bytes in ``dtype`` (parameter count from the safetensors headers,
            times the dtype's size).
        eos_token_id: the end-of-sequence id(s) its generation config (else its config) declares.
    """

    def __init__(self, folder: str, dtype: torch.dtype, device: torch.device):
        from transformers import AutoConfig

        self.folder = str(folder)
        self.config = AutoConfig.from_pretrained(self.folder)
        self.dtype, self.device = dtype, torch.device(device)
        self.nbytes = parameter_count(self.folder) * torch.empty((), dtype=dtype).element_size()
        self.eos_token_id = getattr(self.config, "eos_token_id", None)
        if os.path.isfile(os.path.join(self.folder, "generation_config.json")):
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(self.folder)
            if gen.eos_token_id is not None:
                self.eos_token_id = gen.eos_token_id

    def __repr__(self) -> str:
        return f"DeferredModel({self.folder!r}, dtype={self.dtype}, device={self.device})"

    def load(self):
        """The model, loaded here from `folder` in `dtype` on `device` (eval mode, no grad)."""
        from .models import load_model

        model, _ = load_model(self.folder, dtype=self.dtype, device=str(self.device))
        return model


def parameter_count(folder: str) -> int:
    """Elements of every tensor in a folder's ``*.safetensors`` files, read from their headers
    (nothing is loaded). 0 when the folder has none (e.g. ``pytorch_model.bin`` only)."""
    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= int(d)
                total += count
    return total


def deferrable(source, gguf_file, tp) -> str | None:
    """The folder of a source a sub-server can load itself: a local folder with ``config.json``
    and safetensors weights, no GGUF file named, one rank; None otherwise."""
    if gguf_file is not None or tp not in (None, 1) or not isinstance(source, (str, os.PathLike)):
        return None
    folder = os.path.expanduser(os.fspath(source))
    if os.path.isfile(os.path.join(folder, "config.json")) and any(Path(folder).glob("*.safetensors")):
        return folder
    return None


class LazyModels(Mapping):
    """``Router.models``: model name -> model, in the Router's order. A model the Router loaded
    (or was given) is returned as it is; a `DeferredModel` is loaded in this process at its first
    access (once), or taken from its runner when the runner lives in this process (``local``).

    `info` gives a deferred model's description without loading it.
    """

    def __init__(self, models: dict[str, Any], local: Callable[[str], Any] | None = None):
        self._models = dict(models)
        self.local = local

    def __getitem__(self, name: str):
        m = self._models[name]
        if isinstance(m, DeferredModel):
            here = self.local(name) if self.local is not None else None
            loaded = here if here is not None else m.load()
            self._models[name] = loaded
            return loaded
        return m

    def __iter__(self):
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def __repr__(self) -> str:
        return f"LazyModels({list(self._models)})"

    def info(self, name: str):
        """The model if loaded here, else its `DeferredModel` (config, dtype, device, size)."""
        return self._models[name]

    def loaded(self, name: str) -> bool:
        """Whether the model is in this process already (no load on access)."""
        return not isinstance(self._models[name], DeferredModel)
