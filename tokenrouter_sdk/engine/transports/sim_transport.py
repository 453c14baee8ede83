"""`SimTransport`: the real sub-servers and the engine's event handler in one background thread,
in simulated time (seconds from 0). Any `Runner` works: a step lasts the runner's
``last_forward_s`` (`tokenrouter_sdk.backends.sim_runner.SimRunner` reports a latency model's
seconds there), read through the `Runner` protocol by a wrapper (`_TimedRunner`).

Simulation rule (a conservative discrete-event simulation): a sub-server that can step at
simulated time t starts a step; its forward returns at once but the model is busy until
t + latency(batch); the step's `StepResult` (events, then messages) is delivered at
t + latency. Messages from the engine, and what handling them produces, are delivered at the
current time.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import traceback
from typing import Callable

from ..runner import RunnerInfo, build_runner


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

    def _deliver(self, res, t: float) -> None:
        with self._cv:
            for ev in res.events:
                heapq.heappush(self._heap, (t, next(self._seq), None, ev))
            for model, msg in res.messages:
                heapq.heappush(self._heap, (t, next(self._seq), model, msg))

    def pids(self) -> None:
        """None: the sub-servers live in this process."""
        return None

    @property
    def child_threads(self) -> None:
        """None: the sub-servers live in this process."""
        return None

    def pending(self, model: str) -> bool:
        """Whether messages for ``model`` wait to be delivered."""
        with self._cv:
            return any(dest == model for _, _, dest, _ in self._heap)

    def start(self, specs: dict, on_event: Callable[[object], None]) -> None:
        from ..core.subserver import SubServer

        self.subservers = {}
        for name, spec in specs.items():
            spec = dict(spec, runner=_TimedRunner(build_runner(spec["runner"]), self._forwarded(name)))
            self.subservers[name] = SubServer(**spec, clock=self.clock_for(name))
            self._busy[name] = 0.0
        self._on_event = on_event
        self._thread = threading.Thread(target=self._loop, name="tokenrouter-sim", daemon=True)
        self._thread.start()

    def _forwarded(self, name: str) -> Callable[[float], None]:
        def done(dt: float) -> None:
            self._local[name] = self.now + dt

        return done

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._held and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                due = [
                    heapq.heappop(self._heap)
                    for _ in range(len(self._heap))
                    if self._heap and self._heap[0][0] <= self.now
                ]
            for _, _, dest, msg in due:
                if dest is None:
                    try:
                        self._on_event(msg)
                    except Exception:  # noqa: BLE001 - never let an engine error stop the simulation
                        traceback.print_exc()
                else:
                    self.subservers[dest].handle(msg)
            ran = False
            for name, subserver in self.subservers.items():
                res = subserver.take()
                if res:
                    self._deliver(res, self.now)
                if self._busy[name] <= self.now:
                    self._stepping, self._local[name] = name, self.now
                    try:
                        res = subserver.step()
                    finally:
                        self._stepping = None
                    self._deliver(res, self._local[name])
                    if res.ran:
                        self._busy[name] = self._local[name]
                        ran = True
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

    def restart(self, model: str, first=(), timeout: float | None = None) -> None:
        """Not possible in simulated time: one thread runs every sub-server and the engine.

        Raises:
            RuntimeError: always (names this transport and the way on: a new Router).
        """
        raise RuntimeError(
            f"restart('{model}'): {type(self).__name__} cannot restart a sub-server; "
            f"close this Router and build a new one"
        )

    def reported(self) -> dict[str, dict]:
        """Per model, its runner as built (`RunnerInfo.geometry`)."""
        return {name: RunnerInfo.of(subserver.runner.wrapped).geometry() for name, subserver in self.subservers.items()}

    def local_runner(self, model: str):
        """``model``'s runner object (it lives in this process), or None."""
        subserver = self.subservers.get(model)
        return None if subserver is None else subserver.runner.wrapped

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for subserver in self.subservers.values():  # the runners live here: their KV storage ends with them
            runner = subserver.runner.wrapped
            release = getattr(runner, "release", None)
            release() if release is not None else runner.pool.release()


class _TimedRunner:
    """A `Runner` seen through the protocol: ``forward`` runs the runner's, then reports its
    ``last_forward_s`` to ``done`` (the simulated step's length); every other attribute is the
    runner's."""

    def __init__(self, runner, done: Callable[[float], None]):
        self.__dict__["_runner"], self.__dict__["_done"] = runner, done

    @property
    def wrapped(self):
        """The runner this one times (the object the spec built)."""
        return self._runner

    def forward(self, seqs):
        out = self._runner.forward(seqs)
        self._done(float(self._runner.last_forward_s))
        return out

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def __setattr__(self, name, value):  # e.g. a test wrapping ``forward``: the runner's, still timed here
        setattr(self._runner, name, value)
