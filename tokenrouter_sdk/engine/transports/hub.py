"""The message hub every out-of-process transport shares: `HubTransport`.

`HubTransport` has the interface of `ThreadTransport` (``start``, ``send``, ``clock``,
``clock_for``, ``hold``, ``alive``, ``close``). It owns the data path: a pyzmq ROUTER socket that
every sub-server connects to, one hub thread that moves the engine's messages to the
sub-servers, a sub-server's step results to its peers and the engine, and reports a sub-server's
end. How the sub-servers start, are watched and end is its `Launcher`'s: local processes
(`tokenrouter_sdk.engine.transports.process_transport.ProcessLauncher`) or Ray actors
(`tokenrouter_sdk.engine.transports.ray_transport.RayLauncher`). The launcher hands back one `Started`
per model, which the hub watches; it never reads the launcher's own state.

Layout::

    engine --send(model, msg)--> out queue
                                    |
    hub thread: ROUTER (ipc:// or tcp://) <-------> each sub-server: DEALER "i:<model>" (in),
      - engine -> sub-server messages (in send order)                 DEALER "o:<model>" (out)
      - a sub-server's StepResult (one Frame.RESULT):
          its messages forwarded to the peers as bytes, then its events -> on_event(event)
      - a sub-server's end (one of its `Started.sentinels` turns readable) -> ModelDied(model,
        why); what was sent to it and carries a request (Admit, HandoffMsg) -> that request's
        Finished(failed)

Ordering: every message passes through the hub thread, so messages from one sender to one
destination stay in order. A sub-server's step result arrives whole; the hub forwards its
messages to the peers, then hands its events to the engine, before it reads anything else: the
trace records a step before any step that reacts to it, and a handoff reaches the peer before
any `Go` the engine sends in reply (gated modes). What the engine sends inside `hold` (one
`Router.submit`) reaches each sub-server as one batch that it handles whole before it next
schedules.

Serialisation: per-step messages and events travel with the typed codec of `codec` (a tag,
then the fields as msgpack, checked against the dataclass's annotations); a policy travels
cloudpickled in a `codec.PolicyBlob`, so a `Policy` class defined in a notebook cell works in the
sub-servers. A policy is pickled again for every call that uses it and sent when its bytes
changed, so an object edited between calls reaches the sub-servers as it is.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
from typing import Callable, Protocol

from .. import messages
from ..runner import dead_letter
from .codec import FRAMES, Frame, decode, encode, split_result
from .wire import _child_spec, policy_blob


class Started(Protocol):
    """One started sub-server as the hub watches it (a local process or a Ray actor).

    Attributes:
        pid: its process id (None when not known).
        exitcode: its exit code once it ended by itself (None before, or when none is known).
    """

    pid: int | None
    exitcode: int | None

    def sentinels(self) -> list:
        """File descriptors (or objects with ``fileno``) that turn readable when it may have
        ended; the hub then asks `ended`, and keeps asking on every turn of its loop (at least
        every 0.1 s) until it says True: a sentinel may turn readable a moment before `ended`
        does (a process's pipes close before its exit status is there)."""

    def ended(self) -> bool:
        """Whether it has ended (non-blocking)."""

    def signal(self, sig: int) -> None:
        """End it: ``SIGTERM`` asks, ``SIGKILL`` forces (a launcher without signals ends it
        either way)."""

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for it to end."""

    def close(self) -> None:
        """Release what watching it held (after it ended)."""


class Launcher(Protocol):
    """How a `HubTransport`'s sub-servers start, get their specs, are watched and end.

    Attributes:
        kind: how they start (``"forkserver"``, ``"spawn"``, ``"ray"``); None before `prepare`.
        threads: torch threads each sub-server runs with (set by `prepare`).
        what: what the sub-servers are, for error messages (``"sub-server processes"``).
    """

    kind: str | None
    threads: int | None
    what: str

    def prepare(self, specs: dict) -> str | None:
        """Before the hub binds: check the machine, place the sub-servers. Returns the address
        the hub must bind (``"tcp://<node ip>:*"``), or None for the transport's own.

        Raises:
            Exception: the sub-servers cannot be started (names the fix); nothing is left."""

    def launch(
        self, specs: dict, address: str, report: Callable[[str, str], None], started: dict[str, Started]
    ) -> None:
        """Start one sub-server per spec, each connecting to ``address``, and put what the hub
        watches of each into ``started`` as it starts. ``report(model, text)`` records why a
        sub-server failed. Raises what starting raised (the transport then ends every one in
        ``started``)."""

    def deliver(self, specs: dict) -> None:
        """Hand each started sub-server its spec, once the hub runs."""

    def boot(self, model: str, hello: dict, now: float) -> dict:
        """``model``'s start-up record from its ``hi`` (see `HubTransport.boot`)."""

    def adjust(self, event):
        """``event`` as the engine must see it (e.g. its times moved onto this host's clock)."""

    def kill_all(self, started: dict[str, Started]) -> None:
        """End every sub-server still running, forcibly if it must."""

    def close(self) -> None:
        """Release what the launcher holds (folders, placement); after every sub-server ended."""

    def start_error(self, e: BaseException) -> BaseException:
        """The error `start` raises for ``e`` (``e`` itself, or one that names the fix)."""


def exit_text(code: int | None) -> str:
    """``code`` as a reader wants it: ``"exit code -9, killed by SIGKILL"``."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def boot_record(hello: dict, launched: tuple[float, float], pickled: tuple[float, float], now: float) -> dict:
    """A sub-server's start-up times in seconds (`HubTransport.boot`), from its ``hi`` (the
    times `process_child` stamps: ``main``, ``received``, ``loaded``, ``built``, and ``pid``,
    ``preloaded``), when its start began and returned (``launched``), when pickling its spec
    began and ended (``pickled``) and when its ``hi`` arrived (``now``).

    Raises:
        KeyError, TypeError: ``hello`` lacks a time (a sub-server of another version)."""
    (t0, t1), (p0, p1), b = launched, pickled, hello
    return {
        "start": t1 - t0,
        "to_main": b["main"] - t0,
        "pickle": p1 - p0,
        "transfer": b["received"] - max(b["main"], p1),
        "unpickle": b["loaded"] - b["received"],
        "build": b["built"] - b["loaded"],
        "connect": now - b["built"],
        "total": now - min(t0, p0),
        "preloaded": bool(b["preloaded"]),
        "pid": b["pid"],
    }


def release_pools(specs: dict) -> None:
    """Free this process's KV pools of ``specs``' runner objects: each sub-server elsewhere has
    its own (a runner built from its spec has none here)."""
    for spec in specs.values():
        pool = getattr(spec.get("runner"), "pool", None)
        if pool is not None and hasattr(pool, "release"):
            pool.release()


class HubTransport:
    """Sub-servers outside this process, started by ``launcher``, messages through one hub
    thread (see the module docstring).

    Args:
        launcher: how the sub-servers start, are watched and end (`Launcher`).
        address: ``"ipc"`` (default: a Unix socket in a fresh temporary folder, removed on
            close), ``"tcp"`` (``tcp://127.0.0.1`` on a random free port), or a full
            ``"tcp://host:port"`` to bind (sub-servers connect to it; ``*``/``0.0.0.0`` become
            127.0.0.1 for them). A launcher may name its own (`Launcher.prepare`).
        start_timeout: seconds `start` waits for every sub-server to connect; None returns at
            once and messages wait in the hub until their sub-server connects.
        close_timeout: seconds `close` waits for each sub-server to end before ending it.

    Attributes:
        launcher: the `Launcher`.
        procs: model -> its `Started` (set by `start`).
        boot: model -> its start-up record, filled as each sub-server connects (the launcher's
            `Launcher.boot`: for a local process its start-up times in seconds).
        address: the address the hub bound (set by `start`).

    Not provided: ``subservers`` (the sub-servers live elsewhere), so `Engine.idle` checks only
    the engine's own counters.
    """

    clock = staticmethod(time.perf_counter)

    def __init__(
        self,
        launcher: Launcher,
        *,
        address: str = "ipc",
        start_timeout: float | None = 600.0,
        close_timeout: float = 5.0,
    ):
        self.launcher = launcher
        self.address_spec = address
        self.start_timeout = start_timeout
        self.close_timeout = close_timeout
        self.address: str | None = None
        self.procs: dict[str, Started] = {}
        self.boot: dict[str, dict] = {}
        self.subservers: dict = {}  # none in this process
        self._ctx = None
        self._router = None
        self._ipc_dir: str | None = None
        self._out: collections.deque = collections.deque()
        self._wake_r = self._wake_w = None
        self._hub: threading.Thread | None = None
        self._on_event: Callable[[object], None] | None = None
        self._ready: set[str] = set()
        self._dead: set[str] = set()
        self._dead_why: dict[str, str] = {}
        self._errors: dict[str, str] = {}
        self._buffer: dict[str, list[bytes]] = collections.defaultdict(list)
        self._geometry: dict[str, dict] = {}  # model -> its runner as reported in its hi
        self._lock = threading.Lock()
        self._policy_cache: dict[tuple[str, int], bytes] = {}  # (model, key) -> the policy bytes it holds
        self._last_policy: tuple | None = None  # (RegisterPolicy message, its pickled policy)
        self._closing = False
        self._closed = False
        self._started = False
        self._hold_lock = threading.Lock()
        self._holding = 0
        self._poller = None  # the hub thread's zmq.Poller
        self._sentinels: dict[int, str] = {}  # a watched sentinel's fd -> its model (hub thread only)
        self._ending: set[str] = set()  # models a sentinel of which turned readable, not yet ended (hub thread)
        self._control: collections.deque = collections.deque()  # callables the hub thread runs (a restart)
        self._specs: dict[str, dict] = {}  # model -> its spec as a restarted sub-server gets it

    @property
    def start_method(self) -> str | None:
        """How the sub-servers start (`Launcher.kind`)."""
        return self.launcher.kind

    @property
    def child_threads(self) -> int | None:
        """Torch threads each sub-server runs with (`Launcher.threads`; set by `start`)."""
        return self.launcher.threads

    # -- the transport interface ----------------------------------------------------------
    def clock_for(self, model: str) -> Callable[[], float]:
        return time.perf_counter

    @contextlib.contextmanager
    def hold(self):
        """A batch submission: what the engine sends meanwhile is delivered when it ends, each
        sub-server's share as one batch it handles before its next step (so a burst of
        admissions is seen whole, as delayed batching's tail rule expects)."""
        with self._hold_lock:
            self._holding += 1
        try:
            yield
        finally:
            with self._hold_lock:
                self._holding -= 1
            self._wake()

    def send(self, model: str, msg) -> None:
        """Deliver ``msg`` to ``model``'s sub-server (any thread; order kept per caller)."""
        if self._closed:
            return
        if isinstance(msg, messages.RegisterPolicy):
            data = self._policy_bytes(model, msg)
            if data is None:
                return
        elif isinstance(msg, messages.UnregisterPolicy):
            with self._lock:
                self._policy_cache.pop((model, msg.key), None)
            data = encode(msg)
        else:
            data = encode(msg)
        self._out.append((model, data))
        if threading.current_thread() is not self._hub:
            self._wake()

    def start(self, specs: dict, on_event: Callable[[object], None]) -> None:
        """Start one sub-server per spec (its `SubServer` keyword arguments, less clock) with
        the launcher, start the hub thread, hand each its spec and wait until every one has
        connected (``start_timeout``).

        Raises:
            RuntimeError: a sub-server died while starting (its error and exit code are in the
                message) or did not connect in time; every one is ended first.
            Exception: what the launcher raised (e.g. a spec that cannot be pickled, naming the
                model; too few open files, naming ``ulimit -n``); every sub-server is ended first.
        """
        if self._started:
            raise RuntimeError(f"{type(self).__name__}.start was called twice")
        self._started = True
        self._on_event = on_event
        self._specs = {name: _child_spec(spec) for name, spec in specs.items()}  # before the pools are released
        try:
            address = self.launcher.prepare(specs)
            self._open_hub(address or self.address_spec)
            self.launcher.launch(specs, self._connect_address(), self._report, self.procs)
            self._hub = threading.Thread(target=self._hub_loop, name="tokenrouter-hub", daemon=True)
            self._hub.start()
            self.launcher.deliver(specs)
        except BaseException as e:
            self._abort_start()
            err = self.launcher.start_error(e)
            if err is not e:
                raise err from e
            raise
        release_pools(specs)
        if self.start_timeout is not None and not self.wait_ready(self.start_timeout):
            codes = {}
            for m, p in self.procs.items():
                with contextlib.suppress(ValueError):
                    codes[m] = p.exitcode
            why = "; ".join(
                f"'{m}': "
                + (
                    f"died ({exit_text(codes.get(m))})"
                    if m in self._dead or codes.get(m) is not None
                    else "still starting"
                )
                + (f": {self._errors[m]}" if m in self._errors else "")
                for m in self.procs
                if m not in self._ready
            )
            self._closing = True
            self.close()
            raise RuntimeError(
                f"{self.launcher.what} could not start (each must connect within {self.start_timeout} s): {why}"
            )

    def restart(self, model: str, first=(), timeout: float | None = None) -> None:
        """Start ``model``'s sub-server again after it died, from the spec it started with (a
        fresh KV pool, nothing of the dead one's requests), and return once it has connected.
        ``first``: messages it handles before anything else sent to it (the policies in use,
        the thresholds). Until it connects, what is sent to it waits in the hub; a death while
        it starts is reported as any death.

        Args:
            timeout: seconds to wait for it to connect (None: ``start_timeout``, else 600).

        Raises:
            RuntimeError: the transport is closed, ``model`` is running, or the new sub-server
                died while starting or did not connect in time (it is ended; the model stays
                dead); what the launcher raised starting it (names the fix).
            KeyError: no model of that name.
        """
        if self._closed or self._closing or not self._started:
            raise RuntimeError(f"restart('{model}'): the {self.launcher.what} are closed")
        if model not in self.procs:
            raise KeyError(f"restart: no model {model!r}; the models are {list(self.procs)}")
        if model not in self._dead:
            raise RuntimeError(f"restart('{model}'): its sub-server is running; only a dead one is restarted")
        if self._hub is None or not self._hub.is_alive():
            raise RuntimeError(f"restart('{model}'): the sub-server message hub has stopped; build a new Router")
        spec = self._specs[model]
        started: dict[str, Started] = {}
        try:
            self.launcher.launch({model: spec}, self._connect_address(), self._report, started)
        except BaseException as e:
            with contextlib.suppress(Exception):
                self.launcher.kill_all(started)
            err = self.launcher.start_error(e)
            if err is not e:
                raise err from e
            raise
        adopted, failed = threading.Event(), []
        try:
            held = [self._encode_first(model, msg) for msg in first]
        except BaseException:
            self.launcher.kill_all(started)
            raise

        def adopt():  # on the hub thread: nothing is delivered to the model meanwhile
            try:
                with contextlib.suppress(Exception):
                    self.procs[model].close()
                self.procs[model] = started[model]
                for table in (self._errors, self._dead_why):
                    table.pop(model, None)
                with self._lock:
                    for key in [k for k in self._policy_cache if k[0] == model]:
                        del self._policy_cache[key]
                    for msg, data in zip(first, held):
                        if isinstance(msg, messages.RegisterPolicy):
                            self._policy_cache[(model, msg.key)] = data[1]
                self._buffer[model] = [data[0] for data in held]
                self._watch(model, started[model])
                self._dead.discard(model)
                if model in self._ready:  # its hi came first (a launcher that hands the spec at launch)
                    self._deliver(model, self._buffer.pop(model, []))
            except BaseException as e:  # noqa: BLE001 - reported to the caller, never the hub's end
                failed.append(e)
            finally:
                adopted.set()

        self._control.append(adopt)
        self._wake()
        while not adopted.wait(0.1):
            if not self._hub.is_alive():
                failed.append(RuntimeError("the sub-server message hub stopped"))
                break
        if failed:
            self.launcher.kill_all(started)
            raise RuntimeError(f"restart('{model}'): {type(failed[0]).__name__}: {failed[0]}") from failed[0]
        self.launcher.deliver({model: spec})
        limit = timeout if timeout is not None else self.start_timeout if self.start_timeout is not None else 600.0
        deadline = time.monotonic() + limit
        while model not in self._ready:
            if model in self._dead:
                raise RuntimeError(
                    f"restart('{model}'): the new sub-server died while starting: "
                    f"{self._dead_why.get(model, 'no reason given')}"
                )
            if self._closed or self._closing:
                raise RuntimeError(f"restart('{model}'): the Router was closed while the sub-server started")
            if time.monotonic() > deadline:
                started[model].signal(signal.SIGKILL)
                raise RuntimeError(
                    f"restart('{model}'): the new sub-server did not connect within {limit} s; it was ended"
                )
            time.sleep(0.01)

    def _encode_first(self, model: str, msg) -> tuple[bytes, bytes | None]:
        """(wire bytes of ``msg`` for a restarted ``model``, the policy bytes it then holds)."""
        if isinstance(msg, messages.RegisterPolicy):
            blob = policy_blob(msg.key, msg.policy)
            return encode(blob), blob.data
        return encode(msg), None

    def alive(self, model: str) -> bool:
        """Whether the model's sub-server serves. The hub watches every sub-server and reports a
        death (with its exit code) before this turns False, so the engine's own liveness check
        never races ahead of that message."""
        p = self.procs.get(model)
        if p is None or model in self._dead or self._closed:
            return False
        if self._hub is not None and self._hub.is_alive():
            return True
        return self._running(model)

    def reported(self) -> dict[str, dict]:
        """Per model that has connected, its runner as its sub-server built it
        (`RunnerInfo.geometry`, from its ``hi``)."""
        return {name: dict(self._geometry[name]) for name in list(self._geometry)}

    def local_runner(self, model: str):
        """None: every runner lives in its sub-server's process."""
        return None

    def pending(self, model: str) -> bool:
        """False: no sub-server lives in this process (`subservers` is empty)."""
        return False

    def pids(self) -> dict[str, int]:
        """Process id of each sub-server."""
        return {name: p.pid for name, p in self.procs.items()}

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Block until every sub-server has connected to the hub; False if one died or time ran
        out."""
        deadline = time.perf_counter() + timeout
        while True:
            if any(m in self._dead for m in self.procs):
                return False
            if all(m in self._ready for m in self.procs):
                return True
            if time.perf_counter() >= deadline:
                return False
            time.sleep(0.01)

    def close(self, timeout: float | None = None) -> None:
        """Shut every sub-server down (Shutdown, wait, then end the leftovers), stop the hub,
        close the sockets, remove the ipc folder and close the launcher. Idempotent."""
        if self._closed or not self._started:
            self._closed = True
            self.launcher.close()
            return
        timeout = self.close_timeout if timeout is None else timeout
        self._closing = True
        for name in self.procs:
            if name not in self._dead:
                self.send(name, messages.Shutdown())
        deadline = time.monotonic() + timeout
        from multiprocessing.connection import wait

        for name, p in self.procs.items():
            while not self._ended(name) and time.monotonic() < deadline:
                left = deadline - time.monotonic()
                if wait(p.sentinels(), min(0.1, max(0.0, left))):
                    time.sleep(0.01)  # a fork server's death leaves the status pipe readable
        self.launcher.kill_all(self.procs)
        self._closed = True
        self._wake()
        if self._hub is not None and self._hub is not threading.current_thread():
            self._hub.join(timeout)
        self._release(sockets=self._hub is None or not self._hub.is_alive())

    # -- start and end --------------------------------------------------------------------
    def _open_hub(self, address: str) -> None:
        """Bind the hub's ROUTER socket on ``address`` and make its wake-up pipe."""
        import zmq

        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        for opt, val in (
            (zmq.SNDHWM, 0),
            (zmq.RCVHWM, 0),
            (zmq.ROUTER_MANDATORY, 1),
            (zmq.LINGER, 0),
            (zmq.ROUTER_HANDOVER, 1),
        ):  # a restarted sub-server takes its identities over
            self._router.setsockopt(opt, val)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.address = self._bind(self._router, address)

    def _abort_start(self) -> None:
        """End what a failed `start` began: the hub, every sub-server, sockets, folders."""
        self._closing = self._closed = True
        if self._hub is not None:
            self._wake()
            self._hub.join(5.0)
        with contextlib.suppress(Exception):
            self.launcher.kill_all(self.procs)
        self._release(sockets=True)

    def _release(self, sockets: bool) -> None:
        """After the sub-servers were killed: the sockets (``sockets``: not while the hub thread
        still runs, which closes them itself), the wake-up pipe, the IPC folder, each sub-server's
        handle and the launcher."""
        if sockets:
            self._close_sockets()
        self._close_wake()
        self._remove_ipc_dir()
        for p in self.procs.values():
            with contextlib.suppress(Exception):
                p.close()
        self.launcher.close()

    def _close_sockets(self) -> None:
        if self._router is not None:
            with contextlib.suppress(Exception):
                self._router.close(0)
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                self._ctx.term()

    def _close_wake(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _report(self, model: str, text: str) -> None:
        """Record why ``model``'s sub-server failed (its launcher's word; the first one kept)."""
        self._errors.setdefault(model, text)

    # -- internals ------------------------------------------------------------------------
    def _policy_bytes(self, model: str, msg: messages.RegisterPolicy) -> bytes | None:
        """The wire bytes of ``msg`` for ``model``, or None when that sub-server already holds
        these exact bytes. The policy is pickled once per message (one message goes to every
        model)."""
        with self._lock:
            last = self._last_policy
        if last is not None and last[0] is msg:
            blob = last[1]
        else:
            try:
                blob = policy_blob(msg.key, msg.policy)
            except Exception as e:  # noqa: BLE001
                raise TypeError(
                    f"policy {msg.policy!r} cannot be sent to the {self.launcher.what} "
                    f"({type(e).__name__}: {e}); make it picklable (cloudpickle) or run the "
                    f"sub-servers in threads with Router(..., processes=False)"
                ) from e
        with self._lock:
            self._last_policy = (msg, blob)
            if model in self._dead:  # bounced: a restarted sub-server gets its policies anew
                return encode(blob)
            if self._policy_cache.get((model, msg.key)) == blob.data:
                return None
            self._policy_cache[(model, msg.key)] = blob.data
        return encode(blob)

    def _bind(self, sock, spec: str) -> str:
        if spec == "ipc":
            self._ipc_dir = tempfile.mkdtemp(prefix="tokenrouter-")
            addr = f"ipc://{self._ipc_dir}/hub"
            sock.bind(addr)
            return addr
        if spec == "tcp":
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            return f"tcp://127.0.0.1:{port}"
        if spec.startswith("tcp://"):
            sock.bind(spec)
            return sock.getsockopt_string(__import__("zmq").LAST_ENDPOINT)
        raise ValueError(f"{type(self).__name__} address must be 'ipc', 'tcp' or 'tcp://host:port', got {spec!r}")

    def _connect_address(self) -> str:
        addr = self.address
        for wild in ("tcp://0.0.0.0:", "tcp://*:"):
            if addr.startswith(wild):
                return "tcp://127.0.0.1:" + addr[len(wild) :]
        return addr

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def _wake(self) -> None:
        with contextlib.suppress(OSError, TypeError):  # full pipe: the hub wakes anyway
            os.write(self._wake_w, b"x")

    def _running(self, model: str) -> bool:
        return model in self.procs and not self._ended(model)

    def _ended(self, model: str) -> bool:
        return self.procs[model].ended()

    def _deliver(self, dest: str, datas: list[bytes]) -> None:
        """Send messages to ``dest`` as one multipart message (one batch for its inbox); what a
        dead ``dest`` was sent is answered with `dead_letter`."""
        import zmq

        if not datas or dest not in self.procs:
            return
        if dest in self._dead:
            self._bounce(dest, datas)
            return
        if dest not in self._ready:
            self._buffer[dest].extend(datas)
            return
        try:
            self._router.send_multipart([b"i:" + dest.encode(), *datas])
        except zmq.ZMQError:  # the peer is gone (ROUTER_MANDATORY): its death is reported separately
            self._bounce(dest, datas)

    def _bounce(self, dest: str, datas: list[bytes]) -> None:
        why = self._dead_why.get(dest, f"sub-server '{dest}' is not running")
        for data in datas:
            try:
                msg = decode(data)
            except Exception:  # noqa: BLE001 - e.g. a policy envelope: nothing to answer
                continue
            ev = dead_letter(dest, msg, why, time.perf_counter())
            if ev is not None:
                self._emit(ev)

    def _drain_out(self) -> None:
        """Deliver the engine's messages (not during a `hold`), in order per destination."""
        if self._holding or not self._out:
            return
        batches: dict[str, list[bytes]] = {}
        while self._out:
            dest, data = self._out.popleft()
            batches.setdefault(dest, []).append(data)
        for dest, datas in batches.items():
            self._deliver(dest, datas)

    def _emit(self, event) -> None:
        try:
            self._on_event(self.launcher.adjust(event))
        except Exception:  # noqa: BLE001 - never let an engine error kill the hub
            traceback.print_exc()

    def _on_result(self, frames: list[bytes]) -> None:
        """One `StepResult` of a sub-server: its messages go to the peers first (as bytes, one
        batch per peer), then its events to the engine. The hub handles one frame at a time, so
        no peer's reaction to the messages is handled before these events, and the engine's
        reply to them (a gated mode's `Go`) reaches a peer after the handoffs."""
        events, outgoing = split_result(frames)
        batches: dict[str, list[bytes]] = {}
        for dest, data in outgoing:
            batches.setdefault(dest, []).append(data)
        for dest, datas in batches.items():
            self._deliver(dest, datas)
        for data in events:
            self._emit(decode(data))

    def _recv_router(self) -> bool:
        """Handle every message waiting on the ROUTER; True if any."""
        import zmq

        got = False
        while True:
            try:
                ident, kind, *frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return got
            got = True
            self._drain_out()
            src = ident.decode()[2:]
            frame = FRAMES.get(kind)
            if frame is Frame.RESULT:
                self._on_result(frames)
                self._drain_out()
            elif frame is Frame.HELLO:
                self._record_boot(src, frames[0])
                self._ready.add(src)
                self._deliver(src, self._buffer.pop(src, []))
            elif frame is Frame.ERROR:
                self._errors[src] = frames[0].decode(errors="replace")
            else:
                self._errors.setdefault(src, f"sub-server '{src}' sent an unknown frame kind {kind!r}")

    def _record_boot(self, name: str, data: bytes) -> None:
        import json

        now = time.perf_counter()
        try:
            hello = json.loads(data)
        except ValueError:
            hello = {}
        if isinstance(hello, dict) and isinstance(hello.get("runner"), dict):
            self._geometry[name] = hello["runner"]
        try:
            self.boot[name] = self.launcher.boot(name, hello if isinstance(hello, dict) else {}, now)
        except (ValueError, KeyError, TypeError):  # a sub-server of another version: no times
            self.boot[name] = {}

    def _on_death(self, name: str) -> None:
        import zmq

        deadline = time.monotonic() + 0.2  # collect the sub-server's last words (events, error text)
        while time.monotonic() < deadline:
            if self._router.poll(20, zmq.POLLIN):
                self._recv_router()
            elif name in self._errors or self._closing:
                break
        p = self.procs[name]
        p.join(1.0)
        code = p.exitcode
        held = self._buffer.pop(name, [])
        err = self._errors.get(name)
        text = f"sub-server process '{name}' died ({exit_text(code)})" + (f": {err}" if err else "")
        self._dead_why[name] = text
        if not self._closing:
            self._emit(messages.ModelDied(name, text, time.perf_counter()))
        self._dead.add(name)  # after the report: alive() turns False only once the engine knows why
        self._ready.discard(name)  # a restarted sub-server is ready once its own hi arrives
        if not self._closing:
            self._bounce(name, held)

    def _watch(self, name: str, p: Started) -> None:
        """Watch ``p``'s sentinels for ``name``'s end (hub thread)."""
        import zmq

        for s in p.sentinels():
            fd = s if isinstance(s, int) else s.fileno()
            self._sentinels[fd] = name
            self._poller.register(fd, zmq.POLLIN)

    def _unwatch(self, name: str, fds=None) -> None:
        """Stop watching ``name``'s sentinels (``fds``: only those)."""
        for fd in [f for f, n in self._sentinels.items() if n == name and (fds is None or f in fds)]:
            with contextlib.suppress(KeyError):
                self._poller.unregister(fd)
            del self._sentinels[fd]

    def _check_ends(self, ready: dict) -> None:
        """A sub-server's end: one of its sentinels turned readable (it stays readable, so it is
        watched no more) and `Started.ended` says so. A sentinel may turn readable before
        `ended` does (a fork server's death closes a status pipe too; a process's pipes close
        before its exit status is there), so a model whose sentinel fired is asked again on every
        turn until it has ended: its death is never lost."""
        fired = [fd for fd in self._sentinels if fd in ready]
        for fd in fired:
            name = self._sentinels.get(fd)
            if name is not None:
                self._unwatch(name, {fd})
                self._ending.add(name)
        for name in sorted(self._ending):
            if name in self._dead or self._ended(name):
                self._ending.discard(name)
                self._unwatch(name)
                if name not in self._dead:
                    self._on_death(name)

    def _hub_loop(self) -> None:
        import zmq

        self._poller = poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        for name, p in self.procs.items():
            self._watch(name, p)
        try:
            while not self._closed:
                while self._control:
                    self._control.popleft()()
                self._drain_out()
                ready = dict(poller.poll(100))
                if self._router in ready:
                    self._recv_router()
                if self._wake_r in ready:
                    with contextlib.suppress(OSError):
                        while os.read(self._wake_r, 4096):
                            pass
                self._check_ends(ready)
            self._drain_out()
        except Exception as e:  # noqa: BLE001 - the hub is broken: fail everything, say why
            traceback.print_exc()
            if not self._closing:
                for name in self.procs:
                    self._dead.add(name)
                for name in self.procs:
                    self._emit(
                        messages.ModelDied(
                            name, f"the sub-server message hub failed: {type(e).__name__}: {e}", time.perf_counter()
                        )
                    )
        finally:
            if self._closed:
                with contextlib.suppress(Exception):
                    self._router.close(0)
