"""One HTTP request on the engine: a `Call` whose events arrive on the server's event loop, and
which is aborted when the client goes away.

The engine calls the listener on its own thread; the listener only hands each event to the
loop (``call_soon_threadsafe``), so the engine never waits for the network. Events waiting in
the queue are taken together (`Generation.next_events`), so a slow reader gets fewer, larger
chunks instead of falling behind. A disconnect (the ASGI ``http.disconnect`` message, which
uvicorn delivers when the socket closes) aborts every request of the call at the next step of
whichever model holds it; the engine then frees its KV on every model.
"""

from __future__ import annotations

import asyncio

from .errors import APIError
from .prepare import Prepared


async def wait_disconnect(receive) -> None:
    """Return when the client disconnects (after the body was read, the only message left)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class Disconnected(Exception):
    """The client went away; the call was aborted."""


class Generation:
    """The engine call of one HTTP request.

    Args:
        router: the served `Router`.
        prep: the prepared request.
        receive: the ASGI receive channel (to notice a disconnect).
        stream: forward every committed-token event (else only the ends of requests).

    Raises:
        APIError: 503 when the engine cannot take requests (a dead sub-server, a closed Router).
    """

    def __init__(self, router, prep: Prepared, receive, stream: bool):
        self.router, self.prep, self.stream = router, prep, stream
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        try:
            reqs = router.requests(
                prep.sources if prep.sources is not None else prep.prompts, sampling=prep.params, chat=False
            )
            if prep.forced is not None:  # echo + logprobs: the prompt's tokens after the first are scored
                for k, r in enumerate(reqs):
                    r.forced = prep.forced[k // prep.n]
            self.call = router.submit_inputs(reqs, prep.policy, listener=self._listener)
        except RuntimeError as e:  # EngineDeadError, a closed Router
            raise APIError(503, f"the engine cannot serve requests: {e}", None, "engine_unavailable") from None
        self.open = len(self.call)
        self.watcher = asyncio.ensure_future(wait_disconnect(receive))

    def _listener(self, kind: str, h, payload) -> None:
        if kind == "hop" or (kind == "tokens" and not self.stream):
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, h.output.index, payload))
        except RuntimeError:  # the loop is closed: the server stopped; the call is aborted by it
            pass

    @property
    def handles(self):
        return self.call.handles

    async def next_events(self) -> list[tuple]:
        """At least one event, plus every other one already waiting: ``(kind, index, payload)``
        with kind ``"tokens"`` (payload: (`Committed`, text)) or ``"finish"`` (the last text).

        Raises:
            Disconnected: the client went away first (the call is aborted).
        """
        if self.watcher.done():
            self.abort("the client disconnected")
            raise Disconnected()
        if self.queue.empty():
            getter = asyncio.ensure_future(self.queue.get())
            try:
                await asyncio.wait({getter, self.watcher}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                getter.cancel()
                raise
            if not getter.done():
                getter.cancel()
                self.abort("the client disconnected")
                raise Disconnected()
            items = [getter.result()]
        else:
            items = [self.queue.get_nowait()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        self.open -= sum(1 for kind, _, _ in items if kind == "finish")
        return items

    @property
    def finished(self) -> bool:
        return self.open <= 0

    async def wait(self) -> None:
        """Until every request of the call ended.

        Raises:
            Disconnected: the client went away first (the call is aborted).
        """
        while not self.finished:
            await self.next_events()

    def abort(self, reason: str) -> None:
        """Abort every request of the call that has not ended."""
        self.call.abort(reason)

    def close(self) -> None:
        """Stop watching the connection; abort what still runs (a handler left early)."""
        self.watcher.cancel()
        if not self.call.done.is_set():
            self.call.abort("the request handler ended early (client gone or server stopping)")
