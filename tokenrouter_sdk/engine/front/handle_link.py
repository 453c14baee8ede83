"""The narrow seams between a user's handles and the engine that runs them.

A `tokenrouter_sdk.engine.front.call.Call` (one ``generate``/``submit``) and its
`tokenrouter_sdk.engine.front.request_handle.RequestHandle`s are what a user holds; they reach the
engine only through `EngineLink` (a handle reaches its call only through `CallLink`), so the
handle modules import no engine module and the engine is free to change how it keeps them.
"""

from __future__ import annotations

from typing import Callable, Protocol


class EngineLink(Protocol):
    """What a user's handle may ask of the engine that runs it.

    Attributes:
        models: the model names, smallest first.
    """

    models: list[str]

    def check_alive(self) -> None:
        """Report sub-servers that stopped without saying so (their requests then fail)."""

    def abort(self, rid: int, reason: str = "aborted by the user") -> None:
        """End request ``rid`` ``aborted`` with ``reason`` (a no-op once it ended)."""

    def on_done(self, call, fn: Callable[[], None]) -> None:
        """Run ``fn`` when ``call`` ends (from the engine's thread), or now if it has."""

    def events_of(self, call) -> list:
        """A consistent copy of ``call``'s events so far."""


class CallLink(Protocol):
    """What a `RequestHandle` may ask of the call it belongs to.

    Attributes:
        engine: the engine (`EngineLink`).
        listener: ``listener(kind, handle, payload)`` called as the handle grows, or None
            when nobody streams (the text is then decoded once at the end).
    """

    engine: EngineLink
    listener: Callable | None
