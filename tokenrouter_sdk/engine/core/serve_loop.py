"""The loop a thread or a process runs around one `SubServer`: handle the messages that arrived,
hand on what handling produced, run a step, hand on its result, until `Shutdown`. The sim
transport drives the same two calls (`SubServer.handle`, `SubServer.step`) in simulated time.
"""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING, Callable

from ..step_result import StepResult

if TYPE_CHECKING:
    from .subserver import SubServer

__all__ = ["serve"]


def serve(subserver: SubServer, inbox: queue.Queue, deliver: Callable[[StepResult], None], cores=None) -> None:
    """Serve ``subserver`` until `Shutdown`: handle every message waiting in ``inbox`` (block when it
    cannot step), hand what handling produced to ``deliver``, run one step and hand its
    `StepResult` to ``deliver`` (only non-empty results are delivered). The thread transport
    and the sub-server process run this loop; ``deliver`` must keep the order of `StepResult`
    (events before the messages they caused reach a peer's reaction). ``cores``: a
    `tokenrouter_sdk.engine.transports.cores.CoreShare` marked idle before the loop waits and busy (threads
    set to its share) before a step.

    Raises:
        RunnerDied, or whatever a step raises outside a request: the caller reports the model dead.
    """
    while subserver.running:
        try:
            wait = not subserver.can_step()
            if wait and cores is not None:
                cores.idle(len(subserver.sched.seqs))
            subserver.handle(inbox.get(block=wait))
            while True:
                subserver.handle(inbox.get_nowait())
        except queue.Empty:
            pass
        res = subserver.take()
        if res:
            deliver(res)
        if cores is not None and subserver.can_step():
            cores.busy()
        res = subserver.step()
        if res:
            deliver(res)
