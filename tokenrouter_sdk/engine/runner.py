"""The two seams below the engine: what a model backend (`Runner`) and a message carrier
(`Transport`) must offer. The torch backend (`tokenrouter_sdk.backends.torch_runner`), the sim
backend (`tokenrouter_sdk.backends.sim_runner`) and the transports implement them; the engine
depends only on these protocols, never on a backend module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, NamedTuple, Protocol, runtime_checkable

import torch

from .kv_pool import KVPool


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
class Runner(Protocol):
    """One model's forward over a ragged batch, with a private paged KV pool.

    Attributes:
        pool: the model's `KVPool`.
        vocab_size: logits width V (may exceed the tokenizer's: padding rows are masked).
        max_context: positions the model supports, tokens.
        device: where logits come back.
        last_forward_s: seconds inside the last model forward (for overhead metrics).
    """

    pool: KVPool
    vocab_size: int
    max_context: int
    device: torch.device
    last_forward_s: float

    def forward(self, seqs: list[SeqInput]) -> ForwardOut:
        """Feed every request's tokens; return a `ForwardOut`: the last-position logits [B, V],
        the last-layer hidden states [B, H] of each request and, where asked
        (``SeqInput.all_hidden``), the hidden states of every fed position."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Starts the sub-servers and carries messages between them and the engine.

    ``start(specs, on_event)`` builds one `SubServer` per spec (its keyword arguments, less
    clock) and delivers every event to ``on_event``, each `StepResult` whole in the order
    `tokenrouter_sdk.engine.step_result` states; ``subservers`` holds the sub-servers that
    live in this process by model (empty when they live elsewhere), and ``pending(model)``
    says whether messages wait for one of them; ``send(model, msg)`` delivers a
    message to a sub-server (in order per sender); ``hold()`` is a batch submission (delivered
    whole); ``clock()`` is the time; ``alive(model)`` whether it serves; ``close()`` stops all.
    A message to a dead sub-server that carries a request (`Admit`, `HandoffMsg`) is answered
    with that request's ``Finished(failed)``.
    """

    def start(self, specs: dict, on_event: Callable[[object], None]) -> None: ...

    def send(self, model: str, msg) -> None: ...

    def hold(self) -> ContextManager: ...

    def clock(self) -> float: ...

    def alive(self, model: str) -> bool: ...

    def close(self) -> None: ...


def dead_letter(model: str, msg, why: str, t: float):
    """The `Finished(failed)` that answers ``msg`` sent to dead ``model`` (None if ``msg`` carries
    no request)."""
    from . import messages as M
    if isinstance(msg, (M.Admit, M.HandoffMsg)):
        rid = msg.config.rid if isinstance(msg, M.Admit) else msg.rid
        return M.Finished(rid, model, "failed", f"model '{model}' is dead ({why}): the request was routed to it", t)
    return None
