"""Compiled steps: the step forward of `TorchRunner` compiled by ``torch.compile`` (inductor),
with the paged attention left out of the graph as one opaque custom op per layer.

Two forwards compile, whichever the runner's ``model_impl`` runs:
- the native forward (`tokenrouter_sdk.backends.native_forward.decoder_step`): every projection
  is the custom op ``tokenrouter::project(x, residual, index, n_out)``, which runs the eager
  step's own projection (merged, prepacked GEMMs) from a thread-local list; inductor fuses what
  is between them (norms, rotary, SiLU gating). No freezing: the graph holds no GEMM.
- the transformers forward (``decoder(...)`` + the LM head), with inductor's ``freezing``: the
  weights are folded in as constants and prepacked for oneDNN (one more copy of the weights per
  compiled model and process).
vLLM compiles its forward the same way and keeps attention out of the graph as a custom op (its
``unified_attention``) that reads the step's attention metadata from a forward context.

What it gains on a CPU: for the transformers forward, mostly the prepacked GEMMs, which the
native forward already has eagerly; for the native forward, the fused pointwise work (a
compiled step pads one request to two, so a batch of one does more work). On CUDA a compiled
forward is the path to graph replay. Measurements in ``docs/benchmarks.md`` ("Compiled steps
and the bandwidth bound (CPU)").

How: `CompiledForward` wraps the forward in ``torch.compile`` with the token and request
dimensions dynamic: one graph per model serves every batch size and token count (prefill, decode,
extend and mixed steps), so after the first compile a step never waits for another (the runner
pads a batch to at least 2 requests and 2 tokens so that no size is 0 or 1, which dynamo would
specialise). The attention calls the custom op ``tokenrouter::paged_attention(query, key, value,
layer)``; the op reads the step's `ForwardBatch` from a thread-local slot that
`CompiledForward.__call__` fills (each sub-server thread has its own) and runs the same eager
attention as the eager step, with the layer's window, soft-cap and scale from the batch: compiled
and eager steps differ only by the fused arithmetic. The final-logit soft-cap is applied by the
runner after the compiled call, as after an eager one.

Compile cost (measured in ``docs/benchmarks.md``): the transformers forward's graph is larger
and compiles longer than the native one's; inductor's on-disk caches (under
``TORCHINDUCTOR_CACHE_DIR``) make a later process's compile cheaper (dynamo still traces), and in
one process every runner of the same model object reuses the compiled callable
(`compiled_forward`). `TorchRunner` runs the compile in a background thread by default and serves
eager steps until it is ready, so no call waits for it.
"""

from __future__ import annotations

import threading
import time

import torch

from .attention import attend_paged, paged_mask

_LOCAL = threading.local()  # the ForwardBatch of the step this thread runs (set around a compiled call)
_REG_LOCK = threading.Lock()
_REGISTERED = False
OP = "tokenrouter::paged_attention"
PROJECT_OP = "tokenrouter::project"
HOLDER_ATTR = "_tokenrouter_compiled"


def register_op() -> None:
    """Define the custom ops ``tokenrouter::paged_attention`` and ``tokenrouter::project`` once
    per process (thread-safe)."""
    global _REGISTERED
    with _REG_LOCK:
        if _REGISTERED:
            return
        if not hasattr(torch.ops.tokenrouter, "paged_attention"):
            op = torch.library.custom_op(OP, mutates_args=())(_op_impl)
            op.register_fake(_op_fake)
        if not hasattr(torch.ops.tokenrouter, "project"):
            op = torch.library.custom_op(PROJECT_OP, mutates_args=())(_project_impl)
            op.register_fake(_project_fake)
        _REGISTERED = True


def _op_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
    fb = getattr(_LOCAL, "batch", None)
    if fb is None:
        raise RuntimeError("tokenrouter::paged_attention ran outside a compiled step (no ForwardBatch set)")
    return attend_paged(fb, layer, query, key, value)


def _op_fake(query, key, value, layer):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def _project_impl(x: torch.Tensor, residual: torch.Tensor | None, index: int, n_out: int) -> torch.Tensor:
    projections = getattr(_LOCAL, "projections", None)
    if projections is None:
        raise RuntimeError("tokenrouter::project ran outside a compiled native step (no projections set)")
    p = projections[index]
    return p(x, residual) if residual is not None else p.merged(x)


def _project_fake(x, residual, index, n_out):
    return x.new_empty(x.shape[0], n_out)


class _OpProjection:
    """A `Projection` inside a compiled graph: the custom op ``tokenrouter::project`` on the
    projection at ``index`` of the step's list (the same GEMM code as an eager step, opaque to
    the compiler); outputs split as the eager projection's."""

    def __init__(self, index: int, sizes: list[int]):
        self.index, self.sizes, self.n = index, list(sizes), sum(sizes)

    def __call__(self, x, residual=None):
        if residual is not None:
            return torch.ops.tokenrouter.project(x, residual, self.index, self.n)
        y = torch.ops.tokenrouter.project(x, None, self.index, self.n)
        return list(y.split(self.sizes, -1)) if len(self.sizes) > 1 else [y]


def _op_attend(layer, q, k, v):
    """Paged attention in a compiled native step: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
    t = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    return torch.ops.tokenrouter.paged_attention(*t, layer)[0]


class _NativeStep(torch.nn.Module):
    """The native forward (`tokenrouter_sdk.backends.native_forward.decoder_step`) as the compiled
    unit: the norms, rotary embedding, SiLU gating and reshapes are fused by inductor; every
    projection and the paged attention stay custom ops, so they run the eager step's code."""

    def __init__(self, decoder, sizes: list[list[int]]):
        super().__init__()
        self.decoder = decoder
        self._ops = [_OpProjection(i, s) for i, s in enumerate(sizes)]

    def forward(self, ids, pos, last):
        from .native_forward import decoder_step

        logits, hidden, h = decoder_step(self.decoder, self._ops, _op_attend, ids[0], pos[0], last)
        return logits, hidden, h[None]


class _Step(torch.nn.Module):
    """The compiled unit: an ``nn.Module``, so that dynamo lifts the weights as parameters, which
    freezing folds in and prepacks."""

    def __init__(self, decoder, lm_head):
        super().__init__()
        self.decoder, self.lm_head = decoder, lm_head

    def forward(self, ids, pos, last):
        h = self.decoder(
            input_ids=ids, position_ids=pos, attention_mask=paged_mask(ids.device), use_cache=False, tr_op=True
        ).last_hidden_state
        hidden = h[0, last]
        return self.lm_head(hidden), hidden, h


class CompiledForward:
    """One model's step forward, compiled once per model and process: the transformers forward
    (``decoder`` + ``lm_head`` at the last positions) or, with ``sizes``, the native forward.

    Args:
        decoder: the model's decoder (``model.model``), attention already switched to the paged one.
        lm_head: the output projection (transformers forward).
        freezing: inductor's ``freezing`` (weights folded in and prepacked; inference only).
        sizes: the native forward: each projection's output sizes, in
            `NativeForward.projections` order (its GEMMs stay the eager ones, prepacked).

    Call: ``(fb, ids [1, T], pos [1, T], last [B], projections=None)`` -> (logits [B, V],
    hidden [B, H], last_hidden_state [1, T, H]), with T, B >= 2; ``projections``: the native
    forward's (`NativeForward.projections`, after `NativeForward.prepare`).

    Attributes:
        ready: set once a first call (`warm_up`) compiled the graph; error: why it failed, or None.
        compile_s: seconds the first call took (the compile), or None.
    """

    def __init__(self, decoder, lm_head, *, freezing: bool = True, sizes: list[list[int]] | None = None):
        register_op()
        self.freezing = freezing
        self.native = sizes is not None
        self.module = _NativeStep(decoder, sizes) if self.native else _Step(decoder, lm_head)
        # dynamic=None: only the dims marked in __call__ are symbolic (dynamic=True would also make
        # every float attribute, e.g. norm epsilons, a graph input)
        self._fn = torch.compile(self.module, dynamic=None)
        self.ready = threading.Event()
        self.error: str | None = None
        self.compile_s: float | None = None
        self._lock = threading.Lock()

    def __call__(self, fb, ids, pos, last, projections=None):
        _LOCAL.batch, _LOCAL.projections = fb, projections
        try:
            torch._dynamo.mark_dynamic(ids, 1)
            torch._dynamo.mark_dynamic(pos, 1)
            torch._dynamo.mark_dynamic(last, 0)
            # freezing must be in inductor's config when dynamo hands the graph over (``options=``
            # of torch.compile comes too late for it): patched around the call, not process-wide
            with torch._inductor.config.patch(freezing=self.freezing), torch.inference_mode():
                return self._fn(ids, pos, last)
        finally:
            _LOCAL.batch = _LOCAL.projections = None

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
    """Per-model store of its `CompiledForward`s (by kind and freezing flag), kept in the model's
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


def compiled_forward(
    model, decoder, lm_head, *, freezing: bool = True, sizes: list[list[int]] | None = None
) -> CompiledForward:
    """The `CompiledForward` of ``model`` in this process (the native one with ``sizes``): built
    on first use, then shared by every runner of the same model object (a second Router over the
    same models compiles nothing)."""
    with _HOLDER_LOCK:
        holder = model.__dict__.get(HOLDER_ATTR)
        if holder is None:
            holder = model.__dict__[HOLDER_ATTR] = _Holder()
    key = (freezing, None if sizes is None else tuple(map(tuple, sizes)))
    with holder.lock:
        cf = holder.forwards.get(key)
        if cf is None or cf.error is not None:
            cf = holder.forwards[key] = CompiledForward(decoder, lm_head, freezing=freezing, sizes=sizes)
        return cf
