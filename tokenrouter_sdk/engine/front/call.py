"""`Call`: one submission, its requests (handles, in prompt order), its events and its end.

Locking: the engine appends to ``events`` and changes the counters under its lock; a caller
reads ``events`` without it through `Call.events_since` (a list slice is atomic) and waits on
``done``.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

from ...request import RequestOutput
from .request_handle import RequestHandle

if TYPE_CHECKING:
    from .handle_link import EngineLink


class Call:
    """One submission: its requests (handles, in prompt order), its events and its end.

    A `Call` is a sequence of `RequestHandle`s (``call[i]``, ``len(call)``, iteration).

    Attributes:
        events: the call's trace: `Admitted`, `Committed`, `Hopped`, `Finished` of its
            requests and the `StepDone` of every step while it ran, in arrival order.
        limit: requests of this call in flight at most (None: no limit of its own).
        done: set when every request ended.
    """

    def __init__(
        self,
        engine: "EngineLink",
        limit: int | None,
        policy_key: int,
        listener: Callable[[str, RequestHandle, object], None] | None,
    ):
        self.engine, self.limit, self.policy_key, self.listener = engine, limit, policy_key, listener
        self.handles: list[RequestHandle] = []
        self.events: list = []
        self.queue: collections.deque[RequestHandle] = collections.deque()
        self.inflight = 0
        self.open = 0  # requests not ended yet
        self.done = threading.Event()
        self.kv_limited = 0  # most requests in flight when KV reservation held the next one back (0: never)

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, i):
        return self.handles[i]

    def __iter__(self) -> Iterator[RequestHandle]:
        return iter(self.handles)

    def events_since(self, start: int = 0) -> list:
        """A snapshot of the call's events from index ``start`` on, without the engine lock (events
        are only appended; slicing a list is atomic), for views that poll the trace."""
        return self.events[start:]

    @property
    def outputs(self) -> list[RequestOutput]:
        return [h.output for h in self.handles]

    def wait(self, timeout: float | None = None, poll_s: float = 0.25) -> None:
        """Block until every request ended.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the requests keep running; call
                `abort` to end them).
            EngineDeadError: never; a dead sub-server fails the requests it held instead.
        """
        deadline = None if timeout is None else time.perf_counter() + timeout
        while not self.done.wait(poll_s):
            if deadline is not None and time.perf_counter() > deadline:
                left = sum(1 for h in self.handles if not h.done.is_set())
                raise TimeoutError(f"{left} of {len(self.handles)} requests did not finish within {timeout} s")
            self.engine.check_alive()

    async def wait_async(self) -> None:
        """``await`` form of `wait` (resolves on the running loop; no thread is blocked)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def wake():
            if not fut.done():
                fut.set_result(None)

        self.engine.on_done(self, lambda: loop.call_soon_threadsafe(wake))
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(fut), 1.0)
                return
            except asyncio.TimeoutError:
                self.engine.check_alive()

    def abort(self, reason: str = "aborted by the user") -> None:
        """Abort every request of the call that has not ended."""
        for h in self.handles:
            if not h.done.is_set():
                self.engine.abort(h.rid, reason)

    def metrics(self):
        """`tokenrouter_sdk.metrics.Metrics` of this call (O(its events))."""
        from .committed_metrics import compute_metrics

        events = self.engine.events_of(self)
        return compute_metrics(events, {h.rid for h in self.handles}, self.engine.models)
