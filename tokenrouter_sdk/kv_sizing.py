"""How many tokens of KV each model's pool holds, from the memory left once every model's weights
are loaded.

With neither ``max_kv_tokens`` nor ``kv_memory_fraction`` given:
- on an accelerator (CUDA), the pools take ``GPU_FRACTION`` of the device memory left after the
  weights (the free memory the driver reports once every model is loaded; other processes' use
  is already subtracted), as vLLM's ``gpu_memory_utilization`` does for one model;
- on the CPU, ``CPU_SHARE`` of the available RAM (``MemAvailable``), at most ``CPU_CAP_TOKENS``
  tokens per model (the CPU pool is a zero-filled memory map: only the pages written cost RAM).

Models that share a device are planned jointly, as the TokenRouter paper plans co-located models:
every model there gets the same number of tokens T, with T * sum_m (KV bytes per token of m)
= fraction * memory left. The same number because every request reserves its prompt +
``max_new_tokens`` on every model (``kv_admission="reserve"``), so the smallest pool bounds the
requests in flight. ``max_kv_tokens`` sets T for every model instead. `KVSizing` records, per
model, how its size was chosen (`Router.kv_stats` shows it).

A model that an engine's runner loads where it is built (a runner spec such as vLLM's: it has
``device``, ``kv_bytes_per_token()`` and ``weights_bytes()``) is planned with the others; its
weights' bytes are taken off the memory left, since they are not loaded yet when the pools are
planned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GPU_FRACTION = 0.8  # of the device memory left after the weights; the rest: activations, CUDA graphs
CPU_SHARE = 0.25  # of the available RAM
CPU_CAP_TOKENS = 65536  # per model, with the CPU default


@dataclass(frozen=True)
class KVSizing:
    """How one model's KV pool was sized.

    Attributes:
        model: the model name; device: where its pool lives.
        tokens: the pool's capacity, tokens (a multiple of the block size).
        rule: ``"max_kv_tokens"`` (given), ``"kv_memory_fraction"`` (given, or the accelerator
            default), ``"cpu_share"`` (the CPU default), ``"runner"`` (a runner object's own
            pool) or ``"no_memory_info"`` (a device that reports no memory: 8192 tokens).
        fraction: the share of the memory left that all pools on the device take.
        memory_left_bytes: memory left after the weights (free device memory, or available RAM).
        weights_bytes: bytes of the weights of every model on the device (shared tensors once).
        kv_bytes_per_token: this model's KV bytes per token (2 * layers * KV heads * head dim *
            dtype size).
        shared_with: the models planned jointly on the device (this one included).
        cap_tokens: the cap that applied (the CPU default's), else None.
    """

    model: str
    device: str
    tokens: int
    rule: str
    fraction: float | None = None
    memory_left_bytes: int | None = None
    weights_bytes: int | None = None
    kv_bytes_per_token: int | None = None
    shared_with: tuple[str, ...] = ()
    cap_tokens: int | None = None

    def describe(self) -> str:
        """One line: the size and why, e.g. ``75,264 tokens (kv_memory_fraction 0.8 of 112.4 GiB
        left after 17.9 GiB of weights on cuda:0, shared by small, large)``."""
        if self.rule == "max_kv_tokens":
            why = "max_kv_tokens"
        elif self.rule == "runner":
            why = "the runner's own pool"
        elif self.rule == "no_memory_info":
            why = f"{self.device} reports no free memory: the fixed default"
        else:
            what = "of the available RAM" if self.device == "cpu" else "of the memory left"
            why = (
                f"{'kv_memory_fraction' if self.rule == 'kv_memory_fraction' else 'CPU share'} {self.fraction:g} "
                f"{what} ({gib(self.memory_left_bytes)}) after {gib(self.weights_bytes)} of weights on {self.device}"
                f", shared by {', '.join(self.shared_with)}"
            )
            if self.cap_tokens is not None and self.tokens >= self.cap_tokens:
                why += f"; capped at {self.cap_tokens:,} tokens"
        per = f", {self.kv_bytes_per_token / 1024:.1f} KiB/token" if self.kv_bytes_per_token else ""
        return f"{self.tokens:,} tokens ({why}{per})"


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def kv_bytes_per_token(model) -> int:
    """KV bytes one token takes in ``model``'s pool (what `TorchRunner` allocates): 2 (K and V) *
    layers * KV heads * head dim * bytes of the model's dtype (an engine's runner spec says its own)."""
    if _engine(model):
        return int(model.kv_bytes_per_token())
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dtype = getattr(model, "dtype", None) if _deferred(model) else next(model.parameters()).dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * itemsize


def _deferred(model) -> bool:
    """Whether ``model`` is loaded elsewhere later (a `tokenrouter_sdk.deferred.DeferredModel`:
    its size, device and dtype, no parameters here)."""
    return isinstance(getattr(model, "nbytes", None), int) and not hasattr(model, "parameters")


def _engine(model) -> bool:
    """Whether ``model`` is an engine's runner spec (it loads its weights where it is built)."""
    return not isinstance(model, torch.nn.Module) and hasattr(model, "kv_bytes_per_token")


def model_device(model) -> torch.device:
    """The device of a loaded model's weights, or where a `DeferredModel` or an engine's runner
    spec will load."""
    if _engine(model):
        return torch.device(model.device)
    return model.device if _deferred(model) else next(model.parameters()).device


def weights_bytes(models) -> int:
    """Bytes of the parameters and buffers of ``models``, each storage counted once (a zero-copy
    truncation shares the large model's); a `DeferredModel` counts its weights' bytes."""
    seen, total = set(), 0
    for m in models:
        if _deferred(m):
            total += m.nbytes
            continue
        if _engine(m):
            total += int(m.weights_bytes())
            continue
        for t in [*m.parameters(), *m.buffers()]:
            st = t.untyped_storage()
            key = (t.device, st.data_ptr())
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
    return total


def tokens_for(memory_left: int, fraction: float, per_token: list[int], block_size: int, cap: int | None = None) -> int:
    """Tokens T each pool of one device holds: the largest multiple of ``block_size`` with
    T * sum(per_token) <= fraction * memory_left, at most ``cap``.

    Raises:
        ValueError: not even one block fits (names the memory and the fix).
    """
    need = sum(per_token)
    tokens = int(fraction * memory_left) // need
    if cap is not None:
        tokens = min(tokens, cap)
    tokens -= tokens % block_size
    if tokens < block_size:
        raise ValueError(
            f"the KV pools get {fraction:g} of {gib(memory_left)} left after the weights, less than one "
            f"block of {block_size} tokens ({need * block_size:,} bytes for the models sharing the "
            f"device): free memory, put a model on another device, load it in a smaller dtype, or "
            f"pass max_kv_tokens=..."
        )
    return tokens


def memory_left(device: torch.device) -> int | None:
    """Memory left for KV on ``device`` now, bytes: the free memory the CUDA driver reports, the
    available RAM on the CPU (``MemAvailable``, else psutil's), None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            import psutil

            return int(psutil.virtual_memory().available)
        except ImportError:
            return None
    return None


def plan(
    models: dict, *, block_size: int, max_kv_tokens: int | None = None, fraction: float | None = None, probe=None
) -> dict[str, KVSizing]:
    """The `KVSizing` of every model of ``models`` (name -> loaded torch model, `DeferredModel`
    or an engine's runner spec), see the module docstring. ``probe(device)`` gives the memory
    left there (bytes or None; default `memory_left`).

    Raises:
        ValueError: both ``max_kv_tokens`` and ``fraction``; ``fraction`` outside (0, 1]; a
            device whose share holds less than one block.
    """
    if max_kv_tokens is not None and fraction is not None:
        raise ValueError(
            "give max_kv_tokens (tokens per model) or kv_memory_fraction (a share of the memory left), not both"
        )
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {fraction!r}")
    by_device: dict[torch.device, list[str]] = {}
    for name, m in models.items():
        by_device.setdefault(model_device(m), []).append(name)
    out = {}
    for dev, names in by_device.items():
        per = {n: kv_bytes_per_token(models[n]) for n in names}
        weights = weights_bytes([models[n] for n in names])
        common = dict(device=str(dev), weights_bytes=weights, shared_with=tuple(names))
        if max_kv_tokens is not None:
            tokens = -(-max_kv_tokens // block_size) * block_size
            out |= {
                n: KVSizing(n, tokens=tokens, rule="max_kv_tokens", kv_bytes_per_token=per[n], **common) for n in names
            }
            continue
        left = (probe or memory_left)(dev)
        # what a model loaded where it runs (a folder, an engine's runner spec) takes there: not free yet
        to_load = sum(
            int(models[n].weights_bytes()) if _engine(models[n]) else models[n].nbytes
            for n in names
            if _engine(models[n]) or _deferred(models[n])
        )
        if left is not None:
            left = max(0, left - to_load)
        if left is None:
            out |= {
                n: KVSizing(n, tokens=8192, rule="no_memory_info", kv_bytes_per_token=per[n], **common) for n in names
            }
            continue
        cpu_default = dev.type == "cpu" and fraction is None
        frac = fraction if fraction is not None else CPU_SHARE if dev.type == "cpu" else GPU_FRACTION
        cap = CPU_CAP_TOKENS if cpu_default else None
        tokens = tokens_for(left, frac, list(per.values()), block_size, cap)
        rule = "cpu_share" if cpu_default else "kv_memory_fraction"
        out |= {
            n: KVSizing(
                n,
                tokens=tokens,
                rule=rule,
                fraction=frac,
                memory_left_bytes=left,
                kv_bytes_per_token=per[n],
                cap_tokens=cap,
                **common,
            )
            for n in names
        }
    return {n: out[n] for n in models}
