"""How messages move between the engine and the sub-servers.

`ThreadTransport` runs each sub-server in a thread of this process and moves messages over
`queue.Queue`s (no copies, debuggable with breakpoints). A process transport (pyzmq) plugs
in behind the same three calls: ``start``, ``send(model, msg)``, ``close``.
"""

from __future__ import annotations

import queue
import threading

from . import messages as M


class ThreadTransport:
    """Sub-servers in threads of this process.

    Args:
        subservers: name -> `SubServer` (their ``send`` must be this transport's ``send``).
    """

    def __init__(self):
        self.subservers: dict = {}
        self.events: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []

    def emit(self, event) -> None:
        self.events.put(event)

    def send(self, model: str, msg) -> None:
        self.subservers[model].inbox.put(msg)

    def start(self, subservers: dict) -> None:
        self.subservers = dict(subservers)
        for name, ss in self.subservers.items():
            t = threading.Thread(target=self._serve, args=(ss,), name=f"tokenrouter-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, ss) -> None:
        try:
            ss.run()
        except BaseException as e:  # noqa: BLE001 - report, the engine fails its requests
            self.events.put(M.Finished(-1, ss.name, "crashed", f"sub-server '{ss.name}' crashed: "
                                       f"{type(e).__name__}: {e}", 0.0))

    def alive(self, model: str) -> bool:
        return any(t.is_alive() and t.name == f"tokenrouter-{model}" for t in self._threads)

    def close(self, timeout: float = 10.0) -> None:
        for name in self.subservers:
            self.send(name, M.Shutdown())
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()
