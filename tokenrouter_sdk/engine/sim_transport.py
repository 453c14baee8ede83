"""`SimTransport`: the real sub-servers and the engine's event handler in one background thread,
in simulated time (seconds from 0), for runners that report their step time through an
``advance(dt)`` hook (`tokenrouter_sdk.backends.sim_runner.SimRunner`).

Simulation rule (a conservative discrete-event simulation): a sub-server that can step at
simulated time t starts a step; its forward returns at once but the model is busy until
t + latency(batch); every message and event it produces in that step is delivered at
t + latency. Messages from the engine are delivered at the current time.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from typing import Callable


class SimTransport:
    """Runs the sub-servers and the engine's event handler in one background thread, in
    simulated time (seconds from 0). Same interface as `ThreadTransport`."""

    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self._busy: dict[str, float] = {}
        self._local: dict[str, float] = {}
        self._stepping: str | None = None
        self._cv = threading.Condition()
        self._closed = False
        self._held = 0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def hold(self):
        """Freeze simulated time while the engine submits a batch (all of it arrives at once)."""
        with self._cv:
            self._held += 1
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
                self._cv.notify()

    def clock(self) -> float:
        return self.now

    def clock_for(self, model: str) -> Callable[[], float]:
        return lambda: self._local.get(model, self.now) if self._stepping == model else self.now

    def _t(self) -> float:
        return self._local[self._stepping] if self._stepping is not None else self.now

    def send(self, model: str, msg) -> None:
        with self._cv:
            heapq.heappush(self._heap, (self._t(), next(self._seq), model, msg))
            self._cv.notify()

    def emit(self, event) -> None:
        with self._cv:
            heapq.heappush(self._heap, (self._t(), next(self._seq), None, event))

    def start(self, specs: dict, on_event: Callable[[object], None]) -> None:
        from .subserver import SubServer
        self.subservers = {name: SubServer(**spec, send=self.send, emit=self.emit, clock=self.clock_for(name))
                           for name, spec in specs.items()}
        self._on_event = on_event
        for name, ss in self.subservers.items():
            self._busy[name] = 0.0
            ss.runner.advance = self._advancer(name)
        self._thread = threading.Thread(target=self._loop, name="tokenrouter-sim", daemon=True)
        self._thread.start()

    def _advancer(self, name: str):
        def advance(dt: float) -> None:
            self._local[name] = self.now + dt
        return advance

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._held and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                due = [heapq.heappop(self._heap) for _ in range(len(self._heap))
                       if self._heap and self._heap[0][0] <= self.now]
            for _, _, dest, msg in due:
                if dest is None:
                    self._on_event(msg)
                else:
                    self.subservers[dest].handle(msg)
            ran = False
            for name, ss in self.subservers.items():
                if self._busy[name] <= self.now:
                    self._stepping, self._local[name] = name, self.now
                    try:
                        if ss.try_step():
                            self._busy[name] = self._local[name]
                            ran = True
                    finally:
                        self._stepping = None
            if due or ran:
                continue
            with self._cv:
                nxt = [t for t in self._busy.values() if t > self.now]
                if self._heap:
                    nxt.append(self._heap[0][0])
                if nxt:
                    self.now = max(self.now, min(nxt))
                elif not self._closed:
                    self._cv.wait(0.05)  # idle: wait for the engine to submit

    def alive(self, model: str) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
