"""Compiled steps: the model forward of `TorchRunner` compiled by ``torch.compile`` (inductor),
with the paged attention left out of the graph as one opaque custom op per layer.

Why: an eager step of a small model on a CPU is bound by how its GEMMs read the weights and by
per-operator overhead: about a thousand operator calls per step for a 30-layer Llama (norms,
rotary, SiLU and multiply, reshapes), each one a dispatch. Inductor fuses the pointwise work
into a few C++ kernels and, with ``freezing`` (inference only), folds the weights in as constants
and prepacks them for oneDNN, whose packed GEMM reads them faster at small batch than the eager
``mm`` (SmolLM2-135M fp32 at batch 8 on this project's 2-core CPU: about 80 ms against 95 ms per
decode step, `evals/throughput/peers.py` and `docs/benchmarks.md`). vLLM compiles its forward the
same way and keeps attention out of the graph as a custom op (its ``unified_attention``) that
reads the step's attention metadata from a forward context; this module does the same.

How: `CompiledForward` wraps ``decoder(...)`` + the LM head on each request's last position in
``torch.compile`` with the token and request dimensions dynamic: one graph per model serves every batch size and token count
(prefill, decode, extend and mixed steps), so after the first compile a step never waits for
another (the runner pads a batch to at least 2 requests and 2 tokens so that no size is 0 or 1,
which dynamo would specialise). The attention function (`paged_attention` with ``tr_op=True``)
calls the custom op ``tokenrouter::paged_attention(query, key, value, layer, scale)``; the op reads
the step's `ForwardBatch` from a thread-local slot that `CompiledForward.__call__` fills (each
sub-server thread has its own) and runs the same eager attention as the eager step
(`attend_paged`): compiled and eager steps differ only by the fused non-attention arithmetic.

Compile cost (measured on the 2-core CPU, SmolLM2-135M, see `docs/benchmarks.md`): the first
compile of a model in a process traces and compiles for about a minute or more cold; inductor's
on-disk caches (FX graph cache, under ``TORCHINDUCTOR_CACHE_DIR``) make a later process's compile
of the same model cheaper (no C++ compile; dynamo still traces), and in one process every runner
of the same model object reuses the compiled callable (`compiled_forward`). `TorchRunner` runs the
compile in a background thread by default and serves eager steps until it is ready, so no call
waits for it.

Memory: freezing keeps a prepacked copy of the weights inside the compiled graph (one more copy
of the model's weights per compiled model and process).
"""

from __future__ import annotations

import threading
import time

import torch

_LOCAL = threading.local()  # the ForwardBatch of the step this thread runs (set around a compiled call)
_REG_LOCK = threading.Lock()
_REGISTERED = False
OP = "tokenrouter::paged_attention"
HOLDER_ATTR = "_tokenrouter_compiled"


def register_op() -> None:
    """Define the custom op ``tokenrouter::paged_attention`` once per process (thread-safe)."""
    global _REGISTERED
    with _REG_LOCK:
        if _REGISTERED:
            return
        if not hasattr(torch.ops.tokenrouter, "paged_attention"):
            op = torch.library.custom_op(OP, mutates_args=())(_op_impl)
            op.register_fake(_op_fake)
        _REGISTERED = True


def _op_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    from .torch_runner import attend_paged
    fb = getattr(_LOCAL, "batch", None)
    if fb is None:
        raise RuntimeError("tokenrouter::paged_attention ran outside a compiled step (no ForwardBatch set)")
    return attend_paged(fb, layer, query, key, value, scale)


def _op_fake(query, key, value, layer, scale):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


class _Step(torch.nn.Module):
    """The compiled unit: an ``nn.Module``, so that dynamo lifts the weights as parameters, which
    freezing folds in and prepacks."""

    def __init__(self, decoder, lm_head):
        super().__init__()
        self.decoder, self.lm_head = decoder, lm_head

    def forward(self, ids, pos, last):
        h = self.decoder(input_ids=ids, position_ids=pos, use_cache=False, tr_op=True).last_hidden_state
        hidden = h[0, last]
        return self.lm_head(hidden), hidden, h


class CompiledForward:
    """``decoder`` + ``lm_head`` at the last positions, compiled once per model and process.

    Args:
        decoder: the model's decoder (``model.model``), attention already switched to the paged one.
        lm_head: the output projection.
        freezing: inductor's ``freezing`` (weights folded in and prepacked; inference only).

    Call: ``(fb, ids [1, T], pos [1, T], last [B])`` -> (logits [B, V], hidden [B, H],
    last_hidden_state [1, T, H]), with T, B >= 2.

    Attributes:
        ready: set once a first call (`warm_up`) compiled the graph; error: why it failed, or None.
        compile_s: seconds the first call took (the compile), or None.
    """

    def __init__(self, decoder, lm_head, *, freezing: bool = True):
        register_op()
        self.freezing = freezing
        self.module = _Step(decoder, lm_head)
        # dynamic=None: only the dims marked in __call__ are symbolic (dynamic=True would also make
        # every float attribute, e.g. norm epsilons, a graph input)
        self._fn = torch.compile(self.module, dynamic=None)
        self.ready = threading.Event()
        self.error: str | None = None
        self.compile_s: float | None = None
        self._lock = threading.Lock()

    def __call__(self, fb, ids, pos, last):
        _LOCAL.batch = fb
        try:
            torch._dynamo.mark_dynamic(ids, 1)
            torch._dynamo.mark_dynamic(pos, 1)
            torch._dynamo.mark_dynamic(last, 0)
            # freezing must be in inductor's config when dynamo hands the graph over (``options=``
            # of torch.compile comes too late for it): patched around the call, not process-wide
            with torch._inductor.config.patch(freezing=self.freezing), torch.inference_mode():
                return self._fn(ids, pos, last)
        finally:
            _LOCAL.batch = None

    def warm_up(self, batch) -> bool:
        """Compile by running ``batch`` (``(fb, ids, pos, last)`` writing only scratch slots) once,
        unless done already (then return at once; a concurrent caller waits for the first).
        Returns whether the compiled forward is usable; a failure is kept in ``error``."""
        with self._lock:
            if self.ready.is_set() or self.error is not None:
                return self.error is None
            t0 = time.perf_counter()
            try:
                self(*batch)
            except Exception as e:  # noqa: BLE001 - the runner falls back to eager steps and says why
                self.error = f"{type(e).__name__}: {e}"
                return False
            self.compile_s = time.perf_counter() - t0
            self.ready.set()
            return True


class _Holder:
    """Per-model store of its `CompiledForward`s (by freezing flag), kept in the model's
    ``__dict__`` so it lives as long as the model; it never travels: pickling or copying the
    model gives an empty one (compiled code belongs to the process that compiled it)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.forwards: dict[bool, CompiledForward] = {}

    def __reduce__(self):
        return (_Holder, ())

    def __deepcopy__(self, memo):
        return _Holder()


_HOLDER_LOCK = threading.Lock()


def compiled_forward(model, decoder, lm_head, *, freezing: bool = True) -> CompiledForward:
    """The `CompiledForward` of ``model`` in this process: built on first use, then shared by
    every runner of the same model object (a second Router over the same models compiles nothing)."""
    with _HOLDER_LOCK:
        holder = model.__dict__.get(HOLDER_ATTR)
        if holder is None:
            holder = model.__dict__[HOLDER_ATTR] = _Holder()
    with holder.lock:
        cf = holder.forwards.get(freezing)
        if cf is None or cf.error is not None:
            cf = holder.forwards[freezing] = CompiledForward(decoder, lm_head, freezing=freezing)
        return cf
