"""The seams below the engine: what a model backend (`Runner`, and `RunnerSpec`, the recipe a
runner is built from in the process that runs it) and a message carrier (`Transport`) must offer.
The torch backend (`tokenrouter_sdk.backends.torch_runner`), the sim backend
(`tokenrouter_sdk.backends.sim_runner`) and the transports implement them; the engine depends
only on these protocols, never on a backend module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, NamedTuple, Protocol, runtime_checkable

import torch


class RunnerDied(RuntimeError):
    """A runner can serve no step any more (e.g. a tensor-parallel rank died): its sub-server
    stops and reports its model dead, instead of failing request after request."""


@dataclass
class SeqInput:
    """One request's part of a step: feed ``tokens`` at positions [start, start + len(tokens)),
    with K/V written to (and read from) the slots of block ``table`` in the runner's pool.
    ``all_hidden``: also return the last-layer hidden state of every fed position (see
    `Runner.forward`)."""

    tokens: list[int]
    start: int
    table: list[int]
    all_hidden: bool = False


class ForwardOut(NamedTuple):
    """What `Runner.forward` returns.

    Attributes:
        logits: last-position logits per input, [B, V].
        hidden: last-layer hidden states at those positions, [B, H].
        fed_hidden: when an input asked (``SeqInput.all_hidden``): per input, the hidden states
            of every fed position [len(tokens), H], or None where not asked; None when no input
            asked (or the runner cannot: a policy reading `Step.prompt_hidden` then gets an error).
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    fed_hidden: list | None = None


@runtime_checkable
class KVGeometry(Protocol):
    """The shape of a runner's paged KV storage, the only KV contract between a runner and its
    sub-server: block ids ``0..num_blocks-1`` of ``block_size`` tokens each, which the
    sub-server's `tokenrouter_sdk.engine.core.block_allocator.BlockAllocator` hands out. Our torch
    runners' `tokenrouter_sdk.engine.core.kv_pool.KVPool` (the tensors) and `PoolShape` (geometry
    only: a runner whose storage is elsewhere, or that has none) have it.

    Attributes:
        num_blocks: usable blocks.
        block_size: tokens per block.
        capacity_tokens: ``num_blocks * block_size``.
    """

    num_blocks: int
    block_size: int

    @property
    def capacity_tokens(self) -> int: ...

    def release(self) -> None:
        """Free the storage (the runner serves no step afterwards); nothing for a geometry."""
        ...


@runtime_checkable
class Runner(Protocol):
    """One model's forward over a ragged batch, writing and reading its own paged KV storage at
    the block ids of each input's table.

    Attributes:
        pool: the `KVGeometry` of its KV storage (a `KVPool` for the torch runners).
        vocab_size: logits width V (may exceed the tokenizer's: padding rows are masked).
        max_context: positions the model supports, tokens.
        device: where logits come back.
        last_forward_s: seconds inside the last model forward (for overhead metrics).
    """

    pool: KVGeometry
    vocab_size: int
    max_context: int
    device: torch.device
    last_forward_s: float

    def forward(self, seqs: list[SeqInput]) -> ForwardOut:
        """Feed every request's tokens; return a `ForwardOut`: the last-position logits [B, V],
        the last-layer hidden states [B, H] of each request and, where asked
        (``SeqInput.all_hidden``), the hidden states of every fed position."""
        ...


@dataclass(frozen=True)
class PoolShape:
    """A `KVGeometry` without storage: the KV pool of a runner built elsewhere from a
    `RunnerSpec` (what the engine's admission and `Router.kv_sizing` read), or of a runner that
    keeps no KV (the simulator's, scripted test runners).

    Attributes:
        num_blocks: usable blocks.
        block_size: tokens per block.
        scratch_blocks: extra blocks after the usable ones, never handed out.
    """

    num_blocks: int
    block_size: int
    scratch_blocks: int = 0

    @property
    def capacity_tokens(self) -> int:
        """Usable KV capacity, tokens (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

    def release(self) -> None:
        """Nothing to free here: no storage."""


@dataclass(frozen=True)
class RunnerInfo:
    """What the engine needs of a runner before it is built (`RunnerSpec.describe`).

    Attributes:
        vocab_size: logits width V.
        max_context: positions the model supports, tokens.
        device: where the runner computes (and logits come back).
        dtype: the weights' dtype, or None where the backend has none.
        pool: the `PoolShape` of the KV pool the runner will allocate.
        extra: backend attributes the built runner will have (e.g. the torch runner's ``impl``),
            readable on the `RemoteRunner` as attributes.
    """

    vocab_size: int
    max_context: int
    device: torch.device
    dtype: torch.dtype | None
    pool: PoolShape
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, runner) -> "RunnerInfo":
        """What ``runner`` is: a `RunnerSpec`'s ``describe()``, or a built runner's attributes
        (its pool as a `PoolShape`)."""
        if isinstance(runner, RunnerSpec):
            return runner.describe()
        pool = runner.pool
        return cls(
            int(runner.vocab_size),
            int(runner.max_context),
            getattr(runner, "device", None),
            getattr(runner, "dtype", None),
            PoolShape(int(pool.num_blocks), int(pool.block_size), int(getattr(pool, "scratch_blocks", 0))),
        )

    def geometry(self) -> dict:
        """What the engine plans with: ``vocab_size``, ``max_context``, ``num_blocks``,
        ``block_size`` (the form a sub-server reports it in when it starts)."""
        return {
            "vocab_size": int(self.vocab_size),
            "max_context": int(self.max_context),
            "num_blocks": int(self.pool.num_blocks),
            "block_size": int(self.pool.block_size),
        }


@runtime_checkable
class RunnerSpec(Protocol):
    """A picklable recipe of a `Runner`: shipped to the process (thread, child process, Ray
    actor) that serves the model, which calls `build` there, so the runner, its KV pool and any
    per-process state (compiled code, CUDA graphs, packed weights) are made where they are used.

    ``describe()`` says in this process what the built runner will be (`RunnerInfo`), without
    allocating its pool; it raises what building would raise for a bad setting or an unsupported
    model, so a Router fails at once in the caller. ``build()`` returns the `Runner`.
    """

    def describe(self) -> RunnerInfo: ...

    def build(self) -> Runner: ...


def build_runner(runner):
    """``runner.build()`` when ``runner`` is a `RunnerSpec`, else ``runner`` itself (a runner
    object travels as it is). Builds in one process run one at a time (`tokenrouter_sdk.build_lock`:
    loading a model changes torch's process-wide default dtype for its duration)."""
    if not isinstance(runner, RunnerSpec):
        return runner
    from ..build_lock import MODEL_BUILD

    with MODEL_BUILD:
        return runner.build()


_NOT_DELEGATED = frozenset({"build", "describe", "forward"})  # a view is neither a spec nor a runner


class RemoteRunner:
    """This process's view of a runner built elsewhere from a `RunnerSpec` (in a sub-server
    process or a Ray actor): the attributes of its `RunnerInfo` (``vocab_size``,
    ``max_context``, ``device``, ``dtype``, ``pool`` as a `PoolShape`, and the ``extra`` ones),
    then the spec's own attributes (its settings). It has no ``forward``: steps run where the
    runner lives.

    Args:
        runner_spec: the spec the runner is built from.
        info: its `RunnerInfo`; None: ``runner_spec.describe()``.

    Attributes:
        runner_spec: the `RunnerSpec`.
        info: its `RunnerInfo`.
        last_forward_s: 0.0 (the runner's own is in its process).
    """

    last_forward_s = 0.0

    def __init__(self, runner_spec: RunnerSpec, info: RunnerInfo | None = None):
        info = info if info is not None else runner_spec.describe()
        self.runner_spec, self.info = runner_spec, info
        self.vocab_size, self.max_context = info.vocab_size, info.max_context
        self.device, self.dtype, self.pool = info.device, info.dtype, info.pool

    def __getattr__(self, name: str):
        if name.startswith("__") or name in _NOT_DELEGATED:
            raise AttributeError(name)
        info = self.__dict__.get("info")
        if info is not None and name in info.extra:
            return info.extra[name]
        spec = self.__dict__.get("runner_spec")
        if spec is not None and not name.startswith("_"):
            return getattr(spec, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"RemoteRunner({self.runner_spec!r})"

    def release(self) -> None:
        """Nothing to free in this process: the runner lives where it was built."""


@runtime_checkable
class Transport(Protocol):
    """Starts the sub-servers and carries messages between them and the engine.

    ``start(specs, on_event)`` builds one `SubServer` per spec (its keyword arguments, less
    clock; a ``runner`` that is a `RunnerSpec` is built where the sub-server runs, with
    `build_runner`) and delivers every event to ``on_event``, each `StepResult` whole in the order
    `tokenrouter_sdk.engine.step_result` states; ``subservers`` holds the sub-servers that
    live in this process by model (empty when they live elsewhere), and ``pending(model)``
    says whether messages wait for one of them; ``send(model, msg)`` delivers a
    message to a sub-server (in order per sender); ``hold()`` is a batch submission (delivered
    whole); ``clock()`` is the time; ``alive(model)`` whether it serves; ``close()`` stops all;
    ``pids()`` and ``child_threads`` describe sub-server processes (the Router shows them).
    A message to a dead sub-server that carries a request (`Admit`, `HandoffMsg`) is answered
    with that request's ``Finished(failed)``. The engine calls every method below; a transport
    that cannot do one (`SimTransport` cannot ``restart``) raises ``RuntimeError`` naming
    itself, and one that has nothing to say returns the neutral answer its docstring names.
    """

    def start(self, specs: dict, on_event: Callable[[object], None]) -> None: ...

    def send(self, model: str, msg) -> None: ...

    def hold(self) -> ContextManager: ...

    def clock(self) -> float: ...

    def alive(self, model: str) -> bool: ...

    def close(self) -> None: ...

    def restart(self, model: str, first=(), timeout: float | None = None) -> None:
        """Start dead ``model``'s sub-server again from its spec; ``first``: messages it handles
        before anything else sent to it; returns once it serves (``timeout``: seconds to wait
        for that, where the transport waits; None: its default).

        Raises:
            RuntimeError: ``model`` is running, the new sub-server failed to start, or the
                transport cannot restart a sub-server (the message names it and says to build a
                new Router).
            KeyError: no model of that name.
        """
        ...

    def reported(self) -> dict[str, dict]:
        """Per model whose sub-server has been built, its runner as built there
        (`RunnerInfo.geometry`); ``{}`` from a transport that learns nothing of it."""
        ...

    def local_runner(self, model: str):
        """``model``'s runner object when it lives in this process, else None."""
        ...

    def pending(self, model: str) -> bool:
        """Whether messages for ``model`` wait to be delivered in this process (False when its
        sub-server lives elsewhere)."""
        ...

    def pids(self) -> dict[str, int] | None:
        """Per model, the process id of its sub-server; None when the sub-servers live in this
        process."""
        ...

    @property
    def child_threads(self) -> int | None:
        """Torch threads each sub-server process runs with; None when the sub-servers live in
        this process or the count is not set yet."""
        ...


def dead_letter(model: str, msg, why: str, t: float):
    """The `Finished(failed)` that answers ``msg`` sent to dead ``model`` (None if ``msg`` carries
    no request)."""
    from . import messages

    if isinstance(msg, (messages.Admit, messages.HandoffMsg)):
        rid = msg.config.rid if isinstance(msg, messages.Admit) else msg.rid
        error = f"model '{model}' is dead ({why}): the request was routed to it"
        return messages.Finished(rid, model, "failed", error, t, undelivered=True)
    return None
