"""What one sub-server step returns: its events for the engine and its messages for peers.

A `StepResult` is the whole output of a `SubServer.step` (or of `SubServer.take`, the effects
of the messages handled since the last step). Transports deliver each result whole, in this
order, so the trace records a step before any step that reacts to it:

1. the events, in order, reach the engine's handler;
2. the messages reach each peer, in order per peer;
3. no reaction to 2 (a peer's step) is handled by the engine before every event of 1, and a
   reply of the engine to 1 (a gated mode's next `Go`) reaches a peer after 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class UnknownMessage(TypeError):
    """A sub-server or the engine received a message of a type it does not handle."""


def dispatch(handlers: dict, msg, receiver: str) -> None:
    """Call ``handlers[type(msg)](msg)``.

    Raises:
        UnknownMessage: no handler for ``type(msg)`` (names ``receiver`` and the type).
    """
    fn = handlers.get(type(msg))
    if fn is None:
        raise UnknownMessage(
            f"{receiver} got a message of unknown type {type(msg).__module__}.{type(msg).__qualname__}: {msg!r:.200}"
        )
    fn(msg)


@dataclass
class StepResult:
    """One step's output.

    Attributes:
        events: for the engine, in order (`Committed`, `Hopped`, `Resampled`, `StepDone`,
            `Finished`, `Idle`, `Stats`).
        messages: ``(peer model, message)`` in send order (`HandoffMsg`, `Release`).
        ran: whether a forward ran.
    """

    events: list = field(default_factory=list)
    messages: list[tuple[str, object]] = field(default_factory=list)
    ran: bool = False

    def __bool__(self) -> bool:
        return bool(self.events or self.messages)
