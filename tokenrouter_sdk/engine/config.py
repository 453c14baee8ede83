"""`EngineConfig`: every engine-wide setting, in one frozen object passed Router -> Engine ->
SubServer. Per-call settings (concurrency, policy, sampling) travel with a submission instead."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Mapping


class Mode(str, enum.Enum):
    """A schedule mode (`EngineConfig.mode`); equal to its name as a string (``Mode.SYNC ==
    "sync"``). What a mode changes is read here once, by the sub-server (when it may step) and
    the engine (rounds, in-flight counts): add a mode by adding a member and its answers below.

    Members:
        ASYNC: each model steps whenever it has a ready request.
        DELAYED: async, but model i launches only when B_i requests are ready (delayed
            batching, TokenRouter paper §4; a tail rule keeps it from deadlocking).
        SYNC: a global step barrier: every live model steps once per round (`Go`).
        MODEL_SYNC: one model steps per round, round robin.
    """

    ASYNC = "async"
    DELAYED = "delayed"
    SYNC = "sync"
    MODEL_SYNC = "model_sync"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def gated(self) -> bool:
        """Models step only on the engine's `Go` of a round (and answer `StepDone` or `Idle`)."""
        return self in (Mode.SYNC, Mode.MODEL_SYNC)

    @property
    def batches_delayed(self) -> bool:
        """A model launches at its threshold B_i; the engine keeps every sub-server told how many
        requests are in flight (the tail rule) and thresholds apply."""
        return self is Mode.DELAYED

    def round_targets(self, live: list[str], turn: int) -> list[str]:
        """Gated modes: the models the round numbered ``turn`` (0, 1, ...) of the round-robin
        starts: every live one (sync) or one in turn (model_sync)."""
        if self is Mode.SYNC:
            return list(live)
        return [live[turn % len(live)]] if live else []


MODES = tuple(m.value for m in Mode)
KV_ADMISSION = ("reserve", "optimistic")
MODEL_IMPLS = ("auto", "native", "transformers")  # EngineConfig.model_impl
KERNEL_MODES = ("auto", "wait", "off")  # EngineConfig.kernels


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings.

    Attributes:
        mode: schedule mode. ``"async"``: each model steps whenever it has a ready request.
            ``"delayed"``: async, but model i launches only when ``thresholds[i]`` requests
            are ready (delayed batching, TokenRouter paper §4; a tail rule keeps it from
            deadlocking). ``"sync"``: a global step barrier (every model finishes its step
            before any starts the next, as the official R2R/CITER code runs).
            ``"model_sync"``: one model at a time, round robin.
        thresholds: delayed batching thresholds B_i per model name (``delayed`` mode; models
            not named get 1), or ``"auto"``: the planner picks them before each call
            (`tokenrouter_sdk.planner.plan_for_router`). Feasibility sum_i (B_i - 1) < N is
            checked per call.
        retain_kv: False frees a request's KV on every handoff, so a return re-prefills its
            whole context (what serving each model separately costs; a baseline).
        max_kv_tokens: KV pool capacity per model, tokens. None: torch models size their pools
            from the memory left after the weights (``kv_memory_fraction``, `tokenrouter_sdk.kv_sizing`);
            the sim backend holds 4,194,304.
        kv_memory_fraction: the share of the memory left on a device once every model's weights
            are on it that the KV pools of the models there take, planned jointly (each gets the
            same number of tokens). None: 0.8 on an accelerator, 0.25 of the available RAM
            (at most 65,536 tokens per model) on the CPU. Not with ``max_kv_tokens``.
        block_size: tokens per KV block.
        max_batch_tokens: tokens fed per step at most, per model (a longer single prompt
            still runs alone).
        max_batch_size: requests per step at most, per model.
        max_concurrency: requests in flight at most over all calls (None: no engine-wide
            limit; each call may set its own).
        kv_admission: ``"reserve"`` (default) admits a request only when every model's pool
            can hold ``prompt + max_new_tokens`` tokens of it beside what the requests in
            flight reserved (a policy may send any request to every model), so requests never
            evict each other; one request is always admitted when none is in flight.
            ``"optimistic"`` admits by count only and preempts (evicts, later recomputes)
            when a pool runs full.
        max_hops_without_commit: handoffs in a row without a committed token before the
            request fails (catches ping-pong policies).
        backend: ``"torch"`` (real models) or ``"sim"`` (latency models, simulated time).
        processes: each sub-server in its own process (True), in a thread of this process
            (False), or None: processes when two or more torch models are served or one on the
            CPU (a CPU forward in a thread other than a process's main one runs slower once
            that process's main thread ran torch: `tokenrouter_sdk.router`), unless the
            environment variable ``TOKENROUTER_PROCESSES`` says 0 or 1. A dict means processes
            and passes its items to `ProcessTransport` (``threads``, ``address``).
        cuda_graphs: serve decode and short-extend steps from captured CUDA graphs (torch
            backend on a GPU).
        compile: serve torch models' steps from the forward compiled by ``torch.compile``
            (`TorchRunner` ``compile``): ``False`` (eager), ``True``/``"background"`` (compiled
            in a background thread of each sub-server at its first step; eager steps until
            then), ``"wait"`` (the first step waits for the compile). Logits equal eager within
            floating-point reassociation; measured gain and compile cost in `docs/benchmarks.md`.
        model_impl: which forward eager steps of torch models run: ``"auto"`` (default: the
            native forward for the Llama, Mistral, Qwen2 and Qwen3 families, with merged and, on a
            CPU, prepacked projections; transformers' forward for every other model),
            ``"native"`` (a model without one raises, saying why) or ``"transformers"`` (the
            model's own forward; no packed copy of its weights). See `TorchRunner` and
            `tokenrouter_sdk.backends.native_forward`.
        kernels: the engine's C++ CPU kernels for torch models on a CPU (`TorchRunner`
            ``kernels``: in-place paged attention; fused norm, rotary and SiLU-gating ops in
            float32 native steps): ``"auto"`` (default: once built, ATen ops until then),
            ``"wait"`` (the first step waits for them; RuntimeError if they cannot be built) or
            ``"off"``.
        allow_unknown_attention: run torch models whose attention uses a feature the paged
            attention does not compute (`TorchRunner` ``allow_unknown_attention``; by default
            such a model is refused when the Router is built, naming the layer and the feature;
            docs/own-models.md lists what is honoured per architecture).
        prefill_peers: at admission, every model the request's policy may use
            (`Policy.may_use`, default all) besides its entry model prefills the prompt too, in
            its next step, and keeps it in KV: the first handoff to such a model then feeds only
            the tokens written since (an extend) instead of the prompt and the whole answer so
            far. Costs one prompt prefill per extra model even when no handoff comes. Outputs
            are the same either way.
        prefix_cache: each model keeps full KV blocks of committed tokens indexed by content
            and reuses them for every request whose tokens start the same (shared prompts,
            sweeps over the same questions, multi-turn chats), across calls; see
            `tokenrouter_sdk.engine.core.prefix_cache`. False: every request feeds all its tokens
            (to measure what the cache saves). With ``retain_kv=False`` a return re-prefills
            only what the cache no longer holds; turn both off for the full re-prefill baseline.

    Raises:
        ValueError: from construction, naming the bad field and what it accepts.
    """

    mode: str = "async"
    thresholds: Mapping[str, int] | str | None = None
    retain_kv: bool = True
    max_kv_tokens: int | None = None
    kv_memory_fraction: float | None = None
    block_size: int = 16
    max_batch_tokens: int = 4096
    max_batch_size: int = 256
    max_concurrency: int | None = None
    kv_admission: str = "reserve"
    max_hops_without_commit: int = 16
    backend: str = "torch"
    processes: bool | dict | None = None
    cuda_graphs: bool = False
    compile: bool | str = False
    model_impl: str = "auto"
    kernels: str = "auto"
    allow_unknown_attention: bool = False
    prefill_peers: bool = False
    prefix_cache: bool = True

    def __post_init__(self):
        if self.max_kv_tokens is not None and self.kv_memory_fraction is not None:
            raise ValueError(
                "give max_kv_tokens (tokens per model) or kv_memory_fraction (a share of the memory "
                "left after the weights), not both"
            )
        f = self.kv_memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"kv_memory_fraction must be a number in (0, 1], got {f!r}")
        if self.mode not in MODES:
            raise ValueError(f"unknown schedule mode {self.mode!r}; choose one of {MODES}")
        object.__setattr__(self, "mode", Mode(self.mode))
        if isinstance(self.thresholds, str) and self.thresholds != "auto":
            raise ValueError(f"thresholds must be a dict of B_i per model or 'auto', got {self.thresholds!r}")
        if self.thresholds and not self.mode.batches_delayed:
            raise ValueError(
                f"thresholds apply to mode='delayed' (delayed batching), but mode is {self.mode!r}: "
                f"drop thresholds or set mode='delayed'"
            )
        if self.backend not in ("torch", "sim"):
            raise ValueError(f"unknown backend {self.backend!r}; choose 'torch' or 'sim'")
        if self.compile not in (False, True, "background", "wait"):
            raise ValueError(f"compile must be False, True, 'background' or 'wait', got {self.compile!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {self.kernels!r}")
        if self.kv_admission not in KV_ADMISSION:
            raise ValueError(f"kv_admission must be one of {KV_ADMISSION}, got {self.kv_admission!r}")
        for name in ("block_size", "max_batch_tokens", "max_batch_size", "max_hops_without_commit"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("max_kv_tokens", "max_concurrency"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")

    @property
    def auto_thresholds(self) -> bool:
        return self.thresholds == "auto"

    def threshold_map(self, models: list[str]) -> dict[str, int]:
        """B_i for every model (1 where not given; all 1 with ``"auto"`` until planned).

        Raises:
            ValueError: a threshold below 1 or naming a model not in ``models``.
        """
        given = {} if isinstance(self.thresholds, str) or self.thresholds is None else dict(self.thresholds)
        return valid_thresholds(given, models)

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)


def valid_thresholds(thresholds: Mapping[str, int], models: list[str]) -> dict[str, int]:
    """``thresholds`` completed with 1 for every model not named.

    Raises:
        ValueError: a threshold below 1 or naming a model not in ``models``.
    """
    bad = {k: v for k, v in thresholds.items() if k not in models or int(v) < 1}
    if bad:
        raise ValueError(f"thresholds {bad} invalid: each must name a model of {models} and be >= 1")
    return {m: int(thresholds.get(m, 1)) for m in models}
