"""How messages move between the engine and the sub-servers.

A transport starts the sub-servers, delivers ``send(model, msg)`` to a sub-server's inbox,
delivers the sub-servers' events to the engine's handler, and says what time it is.
`ThreadTransport` runs each sub-server in a thread of this process and moves messages over
`queue.Queue`s (no copies, debuggable with breakpoints). `SimTransport`
(`tokenrouter_sdk.engine.transports.sim_transport`) runs them in simulated time and `ProcessTransport`
(`tokenrouter_sdk.engine.transports.process_transport`) in processes; all three implement
`tokenrouter_sdk.engine.runner.Transport`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from typing import Callable

from .. import messages
from ..runner import RunnerInfo, RunnerSpec, build_runner, dead_letter


class ThreadTransport:
    """Sub-servers in threads of this process; one collector thread hands events to the engine.

    Each sub-server thread runs `tokenrouter_sdk.engine.core.serve_loop.serve` and delivers each
    `StepResult` under ``_order``: its events go to the engine's queue, then its messages to
    the peers' inboxes. The collector takes ``_order`` (and lets it go) before it hands an
    event on, so the result's messages are in the peers' inboxes before the engine reacts to
    its events (a gated mode's next `Go` finds the handoff there), and a peer's reaction to
    them is queued after them.
    """

    clock = staticmethod(time.perf_counter)

    def __init__(self):
        self.subservers: dict = {}
        self.inboxes: dict[str, queue.Queue] = {}
        self.events: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._dead: dict[str, str] = {}
        self._order = threading.Lock()

    def clock_for(self, model: str) -> Callable[[], float]:
        return time.perf_counter

    @contextlib.contextmanager
    def hold(self):
        """A batch submission (a no-op here; the sim transport freezes time during it)."""
        yield

    def send(self, model: str, msg) -> None:
        if model in self._dead:
            ev = dead_letter(model, msg, self._dead[model], self.clock())
            if ev is not None:
                self.events.put(ev)
            return
        self.inboxes[model].put(msg)

    def _deliver(self, res) -> None:
        with self._order:
            for ev in res.events:
                self.events.put(ev)
            for model, msg in res.messages:
                self.send(model, msg)

    def start(self, specs: dict, on_event: Callable[[object], None]) -> None:
        """Start one thread per spec that builds its `SubServer` (the spec's keyword arguments,
        less clock; a `RunnerSpec` runner is built in that thread) and serves it; returns once
        every sub-server is built.

        Raises:
            whatever building a runner or a sub-server raised (the first model's, in spec
            order); the sub-servers already built are stopped first.
        """
        self.inboxes = {name: queue.Queue() for name in specs}
        self._on_event = on_event
        self._specs = dict(specs)
        built: dict[str, list] = {name: [threading.Event(), None, None] for name in specs}  # done, sub-server, error
        for name, spec in specs.items():
            t = threading.Thread(
                target=self._host, args=(name, spec, built[name]), name=f"tokenrouter-{name}", daemon=True
            )
            t.start()
            self._threads.append(t)
        for done, _, _ in built.values():
            done.wait()
        self.subservers = {name: b[1] for name, b in built.items() if b[1] is not None}
        errors = [b[2] for b in built.values() if b[2] is not None]
        if errors:
            for name in self.subservers:
                self.inboxes[name].put(messages.Shutdown())
            for t in self._threads:
                t.join()
            self._threads.clear()
            for subserver in self.subservers.values():
                release = getattr(subserver.runner, "release", None)
                if release is not None:
                    release()
            self.subservers = {}
            raise errors[0]
        self._collector = threading.Thread(target=self._collect, name="tokenrouter-engine", daemon=True)
        self._collector.start()

    def _host(self, name: str, spec: dict, box: list) -> None:
        """A sub-server thread: build the sub-server (``box``: [done event, sub-server, error]),
        then serve it once every one is built (the engine's start returned)."""
        from ..core.subserver import SubServer

        try:
            spec = dict(spec, runner=build_runner(spec["runner"]))
            box[1] = SubServer(**spec, clock=self.clock_for(name))
        except BaseException as e:  # noqa: BLE001 - re-raised by start in the engine's thread
            box[2] = e
            return
        finally:
            box[0].set()
        self._serve(box[1])

    def _collect(self) -> None:
        while True:
            ev = self.events.get()
            if ev is None:
                return
            with self._order:  # the result this event came with is delivered whole
                pass
            try:
                self._on_event(ev)
            except Exception:  # noqa: BLE001 - never let an engine error stop the delivery of events
                traceback.print_exc()

    def _serve(self, subserver) -> None:
        from ..core.serve_loop import serve

        inbox = self.inboxes[subserver.name]
        try:
            serve(subserver, inbox, self._deliver)
        except BaseException as e:  # noqa: BLE001 - report, the engine fails its requests
            why = f"sub-server '{subserver.name}' crashed: {type(e).__name__}: {e}"
            self._dead[subserver.name] = why
            self.events.put(messages.ModelDied(subserver.name, why, self.clock()))
            while True:  # answer what was sent to it meanwhile
                try:
                    msg = inbox.get_nowait()
                except queue.Empty:
                    break
                ev = dead_letter(subserver.name, msg, why, self.clock())
                if ev is not None:
                    self.events.put(ev)

    def restart(self, model: str, first=(), timeout: float | None = None) -> None:
        """Start ``model``'s sub-server again after it crashed: a runner built from its spec is
        built anew (the dead one's KV storage released first); a runner object given is served
        again with the dead sub-server's blocks freed and its prefix cache emptied. ``first``:
        messages it handles before anything else sent to it. Returns once it is built.
        ``timeout`` is not used (building happens here).

        Raises:
            RuntimeError: ``model`` is running.
            KeyError: no model of that name.
            Exception: what building its runner or sub-server raised (the model stays dead).
        """
        if model not in self.inboxes:
            raise KeyError(f"restart: no model {model!r}; the models are {list(self.inboxes)}")
        if model not in self._dead:
            raise RuntimeError(f"restart('{model}'): its sub-server is running; only a dead one is restarted")
        spec, old = self._specs[model], self.subservers.get(model)
        if old is not None:
            if isinstance(spec["runner"], RunnerSpec):
                release = getattr(old.runner, "release", None)
                release() if release is not None else old.runner.pool.release()
            else:  # the same runner object serves again: give back what the dead sub-server held
                for rid in list(old.sched.seqs):
                    old.sched.remove(rid)
                old.sched.blocks.clear_prefix_cache()
        inbox: queue.Queue = queue.Queue()
        for msg in first:
            inbox.put(msg)
        self.inboxes[model] = inbox  # before the thread serves: it reads its inbox here
        box = [threading.Event(), None, None]
        t = threading.Thread(target=self._host, args=(model, spec, box), name=f"tokenrouter-{model}", daemon=True)
        t.start()
        box[0].wait()
        if box[2] is not None:
            raise box[2]
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        self.subservers[model] = box[1]
        del self._dead[model]  # what is sent from now on reaches the new inbox

    def reported(self) -> dict[str, dict]:
        """Per model, its runner as built in its sub-server thread (`RunnerInfo.geometry`)."""
        return {name: RunnerInfo.of(subserver.runner).geometry() for name, subserver in self.subservers.items()}

    def local_runner(self, model: str):
        """``model``'s runner object (it lives in this process), or None."""
        subserver = self.subservers.get(model)
        return None if subserver is None else subserver.runner

    def pids(self) -> None:
        """None: the sub-servers live in this process."""
        return None

    @property
    def child_threads(self) -> None:
        """None: the sub-servers live in this process."""
        return None

    def pending(self, model: str) -> bool:
        """Whether messages wait in ``model``'s inbox."""
        q = self.inboxes.get(model)
        return q is not None and not q.empty()

    def alive(self, model: str) -> bool:
        return any(t.is_alive() and t.name == f"tokenrouter-{model}" for t in self._threads)

    def close(self, timeout: float = 10.0) -> None:
        for name in self.subservers:
            self.send(name, messages.Shutdown())
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()
        self.events.put(None)
        self._collector.join(timeout)
        for subserver in self.subservers.values():  # the runners live here: their KV storage ends with them
            release = getattr(subserver.runner, "release", None)
            release() if release is not None else subserver.runner.pool.release()
