"""Linear projections of the native decoder forward (`tokenrouter_sdk.backends.native_forward`):
the linears that read one input (q/k/v, gate/up) run as one GEMM over their merged weight,
prepacked for oneDNN on a CPU where that measured faster.

Why: a decode step of a small model on a CPU is bound by how its GEMMs read the weights. At a
few rows, the plain ``F.linear`` (MKL) of float32 weights can read them well below the memory
bandwidth, while oneDNN's matmul over weights reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's ``freezing`` does and what vLLM's
CPU backend does with its own oneDNN binding) can stream them faster; bfloat16 weights go through
oneDNN's AMX/avx512_bf16 kernels. Which of the two is faster depends on the CPU, the shape and
the row count (on one CPU MKL's float32 GEMV keeps up with oneDNN, on another it is slower at
every shape; tables in ``docs/benchmarks.md``, "Projection paths (projection)"), so which path
runs is measured on the machine itself, per shape and row count, at a model's first step
(`tokenrouter_sdk.backends.autotune`; ``TOKENROUTER_PACKING=packed|plain|skinny`` forces it). A
projection that was not tuned runs its packed weight at every row count.

A third path, once the C++ CPU kernels are loaded: float32 steps of a few rows through the
engine's own kernel (``csrc/skinny_gemm.cpp``: the weight packed into column blocks of 32 and
streamed once, x's rows broadcast into register accumulators). Whether it runs is measured
like the others (`Projection.add_skinny` makes its weight; `autotune` times it), and so is how it
prefetches its weight stream (`autotune.tune_prefetch`).

Memory: a packed projection holds one more copy of its weights (the model keeps its own, which
the transformers forward, training and the naive reference read); a projection whose measured
rule runs the few-row kernel at some row count holds one more.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from .autotune import PackRule, Prefetch

PACKABLE = (torch.float32, torch.bfloat16, torch.float16)  # weight dtypes with a oneDNN packed path
DEFAULT_RULE = PackRule.always(True, "default")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` on ``device`` can be prepacked (CPU, oneDNN built in, a dtype
    of `PACKABLE`)."""
    return (
        device.type == "cpu"
        and dtype in PACKABLE
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _plain(mod) -> bool:
    """An ``nn.Linear`` (the class itself, not a subclass that changes its forward) without hooks
    and without a ``forward`` set on the instance."""
    return (
        type(mod) is torch.nn.Linear
        and not mod._forward_hooks
        and not mod._forward_pre_hooks
        and "forward" not in mod.__dict__
        and getattr(mod, "weight", None) is not None
    )


class Projection:
    """Linear modules that read the same input, run as one projection.

    Args:
        mods: the modules (same ``in_features`` for ``nn.Linear``; any callable module otherwise).
        pack: prepack the merged weight for oneDNN (when `packing_available`).

    ``proj(x [M, in])`` returns one output per module, [M, out_i] (views into one tensor when
    the merged path ran). ``proj(x, residual)`` with one module returns ``residual + x W^T + b``
    (the add fused into the GEMM on the packed path).

    A module that is not a plain ``nn.Linear`` (a subclass, a wrapper, a module with hooks such
    as tensor parallelism's all-reduce) is always called as itself, so whatever it does runs.

    Attributes:
        sizes: output features per module.
        packed: the oneDNN packed merged weight, or None.
        skinny: the merged weight packed for the few-row kernel (`add_skinny`), or None.
        rule: the `PackRule` that says, per step size (rows), whether ``packed`` runs (set by
            `tokenrouter_sdk.backends.autotune.tune_packing`; `DEFAULT_RULE` before).
        prefetch: the few-row kernel's prefetch locality by step size (a `Prefetch`; it changes
            speed, not bits), measured per machine by `tune_packing` (non-temporal at every row
            count before).
        watched: the weights it was built from (`watch`); `stale` says whether one was replaced
            or changed in place, or a module gained or lost hooks, since (then the projection
            must be built again).
    """

    def __init__(self, mods, *, pack: bool = True):
        self.mods = list(mods)
        self.plain_mods = [_plain(m) for m in self.mods]
        self.plain = all(self.plain_mods)
        self.sizes = [m.out_features if hasattr(m, "out_features") else None for m in self.mods]
        self.packed = self.bias = self.skinny = None
        self.released = False  # the modules' own weights freed (`release_plain`): packed at every step
        self.rule = DEFAULT_RULE
        self.prefetch = Prefetch()
        self.watched = self.watch()
        if not (self.plain and pack):
            return
        w0 = self.mods[0].weight
        if not packing_available(w0.device, w0.dtype) or any(m.weight.dtype != w0.dtype for m in self.mods):
            return
        w = self._merged_weight()
        if any(m.bias is not None for m in self.mods):
            self.bias = torch.cat(
                [m.bias.detach() if m.bias is not None else w.new_zeros(n) for m, n in zip(self.mods, self.sizes)]
            )
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        except RuntimeError:  # a dtype or shape this oneDNN build does not take: plain GEMMs
            self.packed = self.bias = None

    def _merged_weight(self) -> torch.Tensor:
        w0 = self.mods[0].weight
        return torch.cat([m.weight.detach() for m in self.mods]) if len(self.mods) > 1 else w0.detach()

    def add_skinny(self, ops) -> bool:
        """Pack the merged weight for the few-row kernel (``ops``: ``torch.ops.tokenrouter_cpu``
        with ``skinny_pack``) when this projection has a packed path and float32 weights; returns
        whether it has one now. The rule decides when it runs."""
        if (
            self.skinny is None
            and self.packed is not None
            and not self.released
            and self.mods[0].weight.dtype == torch.float32
        ):
            self.skinny = ops.skinny_pack(self._merged_weight())
        return self.skinny is not None

    def release_plain(self) -> int:
        """Free the modules' own weights (each parameter object stays, with its shape, over a
        one-element storage: its values are gone) and run the packed weight at every step size
        from now on. For a model no one else reads (a sub-server that loaded it itself): it then
        holds one copy of these weights instead of two. Returns the bytes freed (0 when this
        projection has no packed weight or is released already).

        A weight that shares its storage with another tensor (tied embeddings) keeps that
        tensor's values: check first with the owner's parameters, as `NativeForward.release_plain`
        does.
        """
        if self.packed is None or self.released or not self.plain:
            return 0
        freed = 0
        for m in self.mods:
            w = m.weight
            freed += w.untyped_storage().nbytes()
            w.data = w.new_empty(1).expand(w.shape)
        self.released = True
        self.rule = PackRule(
            self.rule.buckets,
            (True,) * len(self.rule.packed),
            f"{self.rule.source}, plain weights released",
            self.rule.skinny,
        )
        self.watched = self.watch()
        return freed

    def path(self, rows: int) -> str:
        """The path a step of ``rows`` tokens runs: ``"skinny"``, ``"packed"`` or ``"plain"``."""
        return self._path(rows, self.skinny)

    def _path(self, rows: int, skinny) -> str:
        """`path` with ``skinny`` the few-row weight read once by the caller, which runs on it:
        a runner sharing this projection may drop the attribute meanwhile (`autotune`)."""
        if self.packed is None:
            return "plain"
        p = self.rule.path(rows)
        if p == "skinny" and skinny is None:
            return "packed" if self.rule(rows) else "plain"
        return p

    def watch(self) -> Watch:
        """A `Watch` of every weight and bias this projection read, as they are now."""
        return Watch(
            (m, a, t, tensor_state(t))
            for m in self.mods
            for a in ("weight", "bias")
            if isinstance(t := getattr(m, a, None), torch.Tensor)
        )

    @property
    def stale(self) -> bool:
        """Whether a module's weight was replaced, moved or changed in place, or a module gained
        or lost hooks, since this was built."""
        return not self.watched.unchanged() or [_plain(m) for m in self.mods] != self.plain_mods

    def merged(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, in] through every module, outputs side by side: [M, sum(sizes)] (a new tensor)."""
        w = self.skinny
        path = self._path(x.shape[0], w)
        if path == "skinny":
            return self.run_skinny(x, weight=w)
        if path == "packed":
            return self.run_packed(x)
        outs = self(x)
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        w = self.skinny
        path = self._path(x.shape[0], w)
        if path == "skinny":
            y = self.run_skinny(x, residual, weight=w)
            if residual is not None:
                return y
            return list(y.split(self.sizes, -1)) if len(self.mods) > 1 else [y]
        if path == "packed":
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
            y = self.run_packed(x)
            return list(y.split(self.sizes, -1)) if len(self.mods) > 1 else [y]
        outs = self.run_plain(x)
        if residual is not None:
            return residual + outs[0]
        return outs

    def run_packed(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, in] through the packed merged weight: [M, sum(sizes)]. Requires ``packed``."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def run_skinny(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, weight=None, prefetch: int | None = None
    ) -> torch.Tensor:
        """``x`` [M, in] through the few-row kernel's weight (``weight``, a ``skinny`` taken
        earlier, else ``skinny``), plus ``residual`` [M, sum(sizes)] when given: [M, sum(sizes)].
        Requires one of them. ``prefetch``: the kernel's prefetch locality, 0..3 (default
        ``self.prefetch`` at M rows)."""
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        w = self.skinny if weight is None else weight
        pf = self.prefetch.at(x.shape[0]) if prefetch is None else prefetch
        return torch.ops.tokenrouter_cpu.skinny_linear(x, w, sum(self.sizes), self.bias, residual, pf)

    def run_plain(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x`` [M, in] through each module's own weight (or the module itself when it is not a
        plain linear): one [M, out_i] per module."""
        if self.plain:
            return [F.linear(x, mod.weight, mod.bias) for mod in self.mods]
        return [mod(x) for mod in self.mods]


def tensor_state(t: torch.Tensor) -> tuple:
    """What changes when a tensor's values may have: its version counter (in-place writes; 0 for
    an inference tensor, which has none and cannot be written outside inference mode) and its
    data pointer (``module.to(...)`` and ``param.data = ...`` keep the object, not the storage)."""
    return (-1 if t.is_inference() else t._version, t.data_ptr())


def _slot(owner, attr: str):
    """The dict ``owner.attr`` is stored in (a module's parameters, buffers or submodules), or
    None for an attribute of any other kind."""
    for d in ("_parameters", "_modules", "_buffers"):
        table = owner.__dict__.get(d)
        if table is not None and attr in table:
            return table
    return None


class Watch:
    """A record of attributes (a module's submodules, a linear's weight and bias) as they were,
    checked in one fast pass (`unchanged`): each attribute must still hold the same object and a
    tensor its `tensor_state`. About 0.1 us per entry, so that a step can check a whole model."""

    def __init__(self, entries=()):
        self.entries: list[tuple] = []
        for owner, attr, value, state in entries:
            self.add(owner, attr, value, state)

    def add(self, owner, attr: str, value, state=None) -> None:
        table = _slot(owner, attr)
        self.entries.append((table if table is not None else owner, attr, value, state, table is not None))

    def extend(self, other: "Watch") -> None:
        self.entries.extend(other.entries)

    def unchanged(self) -> bool:
        for where, attr, value, state, is_table in self.entries:
            now = where.get(attr) if is_table else getattr(where, attr, None)
            if now is not value:
                return False
            if state is not None and ((-1 if state[0] < 0 else value._version), value.data_ptr()) != state:
                return False
        return True


class ProjectionCache:
    """The `Projection`s built for one module (kept in its ``__dict__``, so that models sharing
    layers, e.g. a self-draft and its large model, share them in a process). Never travels:
    pickling or copying gives an empty one (packed weights belong to the process that made them)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.items: dict = {}

    def __reduce__(self):
        return (ProjectionCache, ())

    def __deepcopy__(self, memo):
        return ProjectionCache()


CACHE_ATTR = "_tokenrouter_projections"
_CACHE_LOCK = threading.Lock()


def projection(owner: torch.nn.Module, names: tuple[str, ...], *, pack: bool) -> Projection:
    """The `Projection` of ``owner``'s submodules ``names`` (built once per owner, process and
    weights; built again when a module was replaced, a weight changed or hooks came or went)."""
    with _CACHE_LOCK:
        cache = owner.__dict__.get(CACHE_ATTR)
        if cache is None:
            cache = owner.__dict__[CACHE_ATTR] = ProjectionCache()
    mods = [getattr(owner, n) for n in names]
    with cache.lock:
        p = cache.items.get((names, pack))
        if p is None or p.stale or any(a is not b for a, b in zip(p.mods, mods)):
            p = cache.items[(names, pack)] = Projection(mods, pack=pack)
        return p
