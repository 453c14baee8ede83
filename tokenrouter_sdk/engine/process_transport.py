"""Sub-servers in their own processes, talking over pyzmq.

`ProcessTransport` has the interface of `ThreadTransport` (``start``, ``send``, ``clock``,
``clock_for``, ``hold``, ``alive``, ``close``) and is the default when a `Router` holds two
or more torch models. The child's side lives in `process_child`, the serialisation in `wire`.

Layout::

    parent process                                  one child process per model (fork server)
      engine --send(model, msg)--> out queue          receiver thread: DEALER "i:<model>"
                                      |                   -> inbox
      hub thread: ROUTER (ipc:// or tcp://) <-------> main thread: serve(SubServer, inbox, deliver)
        - engine -> child messages (in send order)        deliver(StepResult): DEALER "o:<model>",
        - child StepResult (one Frame.RESULT):              one Frame.RESULT per result
            its messages forwarded to the peers as bytes, then its events -> on_event(event)
        - child death (process sentinel) -> ModelDied(model, why); what was sent to the dead
          child and carries a request (Admit, HandoffMsg) -> that request's Finished(failed)

Ordering: every message passes through the hub thread, so messages from one sender to one
destination stay in order. A sub-server's step result arrives whole; the hub forwards its
messages to the peers, then hands its events to the engine, before it reads anything else: the
trace records a step before any step that reacts to it, and a handoff reaches the peer before
any `Go` the engine sends in reply (gated modes). What the engine sends inside `hold` (one
`Router.submit`) reaches each sub-server as one batch that it handles whole before it next
schedules.

Start-up: one process per model comes from `process_start` (by default forked from
multiprocessing's fork server, which imported torch and transformers once per interpreter: tens
of milliseconds instead of a fresh interpreter's seconds; ``start_method="spawn"`` gives a fresh
interpreter). The child does not re-import the parent's ``__main__`` script, so a script needs
no ``if __name__ == "__main__"`` guard. Each child gets one end of a Unix socket pair; the
per-model spec (the runner's `RunnerSpec` with its model, or a runner object given as one,
tokenizer, scheduler settings) goes over it (`wire`), and the child builds the runner there,
pickled with cloudpickle (so classes defined in ``__main__`` or a notebook cell travel by
value) plus torch's multiprocessing reductions, after `wire.pack_shared` moved the weights into
a few shared-memory segments (once; a later Router over the same models reuses them): each
segment travels as one file descriptor, so model weights (and the zero-copy truncated small
model, which shares modules with the large one) are mapped once, not copied per process, and a
model pair costs a handful of descriptors, not one per weight tensor. When even those do not fit
under the soft limit of open files, `fd_limit.ensure_room` raises it within the hard limit
(logged) or fails with an error naming ``ulimit -n`` and the numbers. The KV pool is not shared: a
runner built from its spec allocates its pool in the child (this process never has one); a
runner object's pool is re-allocated there with the same shape and this process's copy is
released, so nothing here can write into a sub-server's KV. The child keeps
its end of the pair open while it lives: the hub sees the other end turn readable when it ends
(however it ends, whoever started it).

Serialisation: per-step messages and events travel with the typed codec of `codec` (a tag,
then the fields as msgpack, checked against the dataclass's annotations); a policy travels
cloudpickled in a `codec.PolicyBlob`, so a `Policy` class defined in a notebook cell works in
the sub-server processes. A policy is pickled again
for every call that uses it and sent when its bytes changed, so an object edited between calls
reaches the processes as it is. Sender and receiver run the
same interpreter, never stored.

Timestamps: children stamp events with ``time.perf_counter`` (``CLOCK_MONOTONIC`` on Linux,
one clock for every process of the host), so their times and the engine's are comparable.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from typing import Callable

from . import fd_limit
from . import messages as M
from . import process_start
from .cores import CoreShare, create_flags
from .process_child import _child_main
from .runner import dead_letter
from .codec import FRAMES, Frame, decode, encode, split_result
from .wire import _child_spec, dump_spec, pack_shared, policy_blob, send_spec

FDS_PER_MODEL = 8  # descriptors a sub-server process costs this process at most: spec channel, sentinel,
#                    hub connections, its weights' shared-memory segments (usually one)
FDS_PER_HUB = 16  # the hub: zmq context and socket, wake pipe

# ---- the parent ----------------------------------------------------------------------------
def _release_pool(spec: dict) -> None:
    """Free this process's KV pool of a pickled spec (the child allocates its own of the same
    shape) before the child starts allocating: on a GPU whose pools are sized to the memory left,
    the parent's copy must be gone first (its CUDA cache too)."""
    pool = getattr(spec.get("runner"), "pool", None)
    if pool is None or getattr(pool, "k", None) is None or not hasattr(pool, "release"):
        return
    cuda = pool.k.device.type == "cuda"
    pool.release()
    if cuda:
        import torch
        torch.cuda.empty_cache()



def _release_pools(specs: dict) -> None:
    """Free this process's KV pools of ``specs``: each sub-server elsewhere has its own."""
    for spec in specs.values():
        pool = getattr(spec.get("runner"), "pool", None)
        if pool is not None and hasattr(pool, "release"):
            pool.release()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


class ProcessTransport:
    """Each sub-server in its own process; messages over pyzmq through a hub thread.

    Args:
        threads: torch intra-op threads per sub-server process, fixed. Default (None): core
            lending (`tokenrouter_sdk.engine.cores`): before each step a process takes the CPUs
            this process may use divided by the number of models that have work at that moment,
            so a model alone at work computes on every core.
        address: ``"ipc"`` (default: a Unix socket in a fresh temporary folder, removed on
            close), ``"tcp"`` (``tcp://127.0.0.1`` on a random free port), or a full
            ``"tcp://host:port"`` to bind (children connect to it; ``*``/``0.0.0.0`` become
            127.0.0.1 for them).
        start_timeout: seconds `start` waits for every process to boot and connect (forked
            from the fork server: well under a second plus unpickling the spec; the first time
            in an interpreter, or with ``"spawn"``, a fresh interpreter imports torch and
            transformers: seconds); None returns at once and messages wait in the hub until
            their process connects (the first requests' latency then includes the boot).
        close_timeout: seconds `close` waits for each process to end before terminating it.
        start_method: ``"forkserver"`` or ``"spawn"``; None (default): the fork server on
            Linux when every model is on the CPU, else spawn (set by `start`); see
            `tokenrouter_sdk.engine.process_start`.

    Attributes:
        boot: model -> start-up times in seconds, filled as each process connects:
            ``start`` (`multiprocessing.Process.start`), ``to_main`` (from the start to the
            child's entry point: process creation and, without a preloaded fork server, the
            imports), ``pickle`` (this process pickling the spec: moving weights to shared
            memory the first time), ``transfer`` (from the later of the child's entry and the
            end of pickling until the child has the spec), ``unpickle`` (the child loading it),
            ``build`` (the child building its `SubServer`), ``connect`` (until its ``hi``
            reaches the hub), ``total``; and ``preloaded`` (True when the child was forked with
            the sub-server code already imported) and ``pid``.

    Not provided: ``subservers`` (the sub-servers live in other processes), so
    `Engine.idle` checks only the engine's own counters.
    """

    clock = staticmethod(time.perf_counter)

    def __init__(self, threads: int | None = None, address: str = "ipc", start_timeout: float | None = 600.0,
                 close_timeout: float = 5.0, start_method: str | None = None):
        self.start_method = start_method
        if start_method is not None and start_method not in process_start.START_METHODS:
            raise ValueError(f"ProcessTransport start_method must be one of {process_start.START_METHODS}, "
                             f"got {start_method!r}")
        self.threads = threads
        self.child_threads: int | None = None  # torch threads each child runs with (set by start)
        self.address_spec = address
        self.start_timeout = start_timeout
        self.close_timeout = close_timeout
        self.address: str | None = None
        self.procs: dict = {}
        self.boot: dict[str, dict] = {}
        self._chans: dict[str, socket.socket] = {}  # model -> this end of its spec channel / death sentinel
        self._t_launch: dict[str, tuple[float, float]] = {}  # model -> Process.start began, returned
        self._t_pickle: dict[str, tuple[float, float]] = {}  # model -> pickling its spec began, ended
        self._ctx = None
        self._router = None
        self._ipc_dir: str | None = None
        self._cores_dir: str | None = None
        self._out: collections.deque = collections.deque()
        self._wake_r = self._wake_w = None
        self._hub: threading.Thread | None = None
        self._on_event: Callable[[object], None] | None = None
        self._ready: set[str] = set()
        self._dead: set[str] = set()
        self.subservers: dict = {}  # none in this process
        self._dead_why: dict[str, str] = {}
        self._errors: dict[str, str] = {}
        self._buffer: dict[str, list[bytes]] = collections.defaultdict(list)
        self._proc_lock = threading.Lock()
        self._policy_cache: dict[tuple[str, int], bytes] = {}  # (model, key) -> the policy bytes it holds
        self._last_policy: tuple | None = None  # (RegisterPolicy message, its pickled policy)
        self._closing = False
        self._closed = False
        self._started = False
        self.shared: dict = {}  # what `start` moved into shared memory (`wire.pack_shared`)
        self._hold_lock = threading.Lock()
        self._holding = 0

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
        if isinstance(msg, M.RegisterPolicy):
            data = self._policy_bytes(model, msg)
            if data is None:
                return
        elif isinstance(msg, M.UnregisterPolicy):
            with self._proc_lock:
                self._policy_cache.pop((model, msg.key), None)
            data = encode(msg)
        else:
            data = encode(msg)
        self._out.append((model, data))
        if threading.current_thread() is not self._hub:
            self._wake()

    def start(self, specs: dict, on_event: Callable[[object], None]) -> None:
        """Bind the hub, start one process per spec (its `SubServer` keyword arguments, less
        clock), start the hub thread, send each process its spec and wait until every
        process has connected (``start_timeout``).

        Raises:
            RuntimeError: a process died while starting (its error and exit code are in the
                message) or did not connect in time; every process is ended first.
            ValueError: ``start_method`` is not available on this platform.
            Exception: a spec cannot be pickled (the type of the pickling error, naming the
                model); every process is ended first.
            OSError (EMFILE): too few open files are allowed even after raising the soft limit
                to the hard one (the message names ``ulimit -n`` and the numbers).
        """
        if self._started:
            raise RuntimeError("ProcessTransport.start was called twice")
        what = f"the sub-server processes of {len(specs)} model(s)"
        fd_limit.ensure_room(FDS_PER_MODEL * len(specs) + FDS_PER_HUB, what)
        try:  # the weights into a few shared-memory segments: a handful of descriptors per model
            self.shared = pack_shared([_child_spec(spec).get("runner") for spec in specs.values()])
        except Exception as e:  # noqa: BLE001 - packing is an optimisation: per-storage sharing still works
            err = fd_limit.too_many_files(e, what)
            if err is not e:
                raise err from e
            self.shared = {"error": f"{type(e).__name__}: {e}"}
        self.start_method = self.start_method or process_start.default_start_method(specs)
        mp = process_start.get_context(self.start_method, specs)
        self._open_hub(on_event)
        n = len(specs)
        threads = self.child_threads = self.threads or max(1, _cpus() // max(1, n))
        shares = self._core_shares(list(specs)) if self.threads is None and n > 1 else {}
        try:
            pickled: dict[str, tuple[bytes, list[int]]] = {}
            if self.start_method == "forkserver":  # the fork server imports while this process pickles
                process_start.prestart(self.start_method)
                pickled = {name: self._pickle(name, spec) for name, spec in specs.items()}
            with process_start.no_main_reimport():
                for name in specs:
                    self._launch(mp, name, threads, shares.get(name))
            self._start_hub()
            for name, spec in specs.items():
                data, fds = pickled.pop(name) if name in pickled else self._pickle(name, spec)
                chan = self._chans[name]
                chan.settimeout(self.start_timeout)
                with contextlib.suppress(OSError):  # the process is gone: the hub reports why
                    send_spec(chan, data, fds)
                chan.settimeout(None)
                del data, fds
        except BaseException as e:
            self._closing = self._closed = True
            if self._hub is not None:
                self._wake()
                self._hub.join(5.0)
            self._kill_all()
            self._router.close(0)
            self._ctx.term()
            self._remove_ipc_dir()
            self._close_chans()
            os.close(self._wake_r)
            os.close(self._wake_w)
            err = fd_limit.too_many_files(e, what)
            if err is not e:
                raise err from e
            raise
        _release_pools(specs)
        if self.start_timeout is not None and not self.wait_ready(self.start_timeout):
            with self._proc_lock:
                codes = {m: p.exitcode for m, p in self.procs.items()}
            why = "; ".join(f"'{m}': " + (f"died ({_exit_text(codes[m])})" if m in self._dead or codes[m] is not None
                                          else "still starting") + (f": {self._errors[m]}" if m in self._errors else "")
                            for m in self.procs if m not in self._ready)
            self._closing = True
            self.close()
            raise RuntimeError(f"sub-server processes could not start (each must connect within "
                               f"{self.start_timeout} s): {why}")

    def _open_hub(self, on_event: Callable[[object], None]) -> None:
        """Bind the hub's ROUTER socket (`address`) and make its wake-up pipe."""
        import zmq
        self._started = True
        self._on_event = on_event
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        for opt, val in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.ROUTER_MANDATORY, 1), (zmq.LINGER, 0)):
            self._router.setsockopt(opt, val)
        self.address = self._bind(self._router, self.address_spec)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _start_hub(self) -> None:
        """Start the hub thread (once every process of `procs` is there to watch)."""
        self._hub = threading.Thread(target=self._hub_loop, name="tokenrouter-hub", daemon=True)
        self._hub.start()

    def _core_shares(self, names: list[str]) -> dict:
        """Per model, its `CoreShare` of this machine's cores (core lending, see
        `tokenrouter_sdk.engine.cores`), over a flags file in a fresh folder removed at `close`."""
        self._cores_dir = tempfile.mkdtemp(prefix="tokenrouter-cores-")
        path = os.path.join(self._cores_dir, "busy")
        create_flags(path, len(names))
        return {name: CoreShare(path, i, len(names), _cpus()) for i, name in enumerate(names)}

    def _launch(self, mp, name: str, threads: int, cores: CoreShare | None = None) -> None:
        """Start ``name``'s process with one end of a new spec channel."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._chans[name] = mine
        p = mp.Process(target=_child_main, args=(name, self._connect_address(), threads, theirs, cores),
                       name=f"tokenrouter-{name}", daemon=True)
        t0 = time.perf_counter()
        try:
            p.start()
        except Exception as e:
            raise _with_context(e, f"could not start the sub-server process of model '{name}': {e}; "
                                   f"Router(..., processes=False) runs sub-servers in threads") from e
        finally:
            theirs.close()
        self._t_launch[name] = (t0, time.perf_counter())
        self.procs[name] = p

    def _pickle(self, name: str, spec: dict) -> tuple[bytes, list[int]]:
        t0 = time.perf_counter()
        try:
            out = dump_spec(_child_spec(spec))
        except Exception as e:
            raise _with_context(e, f"the sub-server spec of model '{name}' cannot be sent to its process "
                                   f"({type(e).__name__}: {e}); Router(..., processes=False) runs "
                                   f"sub-servers in threads") from e
        self._t_pickle[name] = (t0, time.perf_counter())
        _release_pool(spec)
        return out

    def alive(self, model: str) -> bool:
        """Whether the model's process serves. The hub watches every process and reports a
        death (with its exit code) before this turns False, so the engine's own liveness check
        never races ahead of that message."""
        p = self.procs.get(model)
        if p is None or model in self._dead or self._closed:
            return False
        if self._hub is not None and self._hub.is_alive():
            return True
        return self._running(model)

    def pending(self, model: str) -> bool:
        """False: no sub-server lives in this process (`subservers` is empty)."""
        return False

    def pids(self) -> dict[str, int]:
        """Process id of each sub-server."""
        return {name: p.pid for name, p in self.procs.items()}

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Block until every child has connected to the hub; False if one died or time ran out."""
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
        """Shut every sub-server down (Shutdown, join, then terminate/kill leftovers), stop the
        hub, close the sockets and remove the ipc folder. Idempotent."""
        if self._closed or not self._started:
            self._closed = True
            return
        timeout = self.close_timeout if timeout is None else timeout
        self._closing = True
        for name in self.procs:
            if name not in self._dead:
                self.send(name, M.Shutdown())
        deadline = time.monotonic() + timeout
        from multiprocessing.connection import wait
        for name, p in self.procs.items():
            while not self._ended(name) and time.monotonic() < deadline:
                left = deadline - time.monotonic()
                if wait([self._chans[name], p.sentinel], min(0.1, max(0.0, left))):
                    time.sleep(0.01)  # a fork server's death leaves the status pipe readable
        self._kill_all()
        self._closed = True
        self._wake()
        if self._hub is not None and self._hub is not threading.current_thread():
            self._hub.join(timeout)
        if self._hub is None or not self._hub.is_alive():
            with contextlib.suppress(Exception):
                self._router.close(0)
            with contextlib.suppress(Exception):
                self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._remove_ipc_dir()
        self._close_chans()
        for p in self.procs.values():
            with contextlib.suppress(Exception):
                p.close()

    # -- internals ------------------------------------------------------------------------
    def _policy_bytes(self, model: str, msg: M.RegisterPolicy) -> bytes | None:
        """The wire bytes of ``msg`` for ``model``, or None when that process already holds these
        exact bytes. The policy is pickled once per message (one message goes to every model)."""
        with self._proc_lock:
            last = self._last_policy
        if last is not None and last[0] is msg:
            blob = last[1]
        else:
            try:
                blob = policy_blob(msg.key, msg.policy)
            except Exception as e:  # noqa: BLE001
                raise TypeError(f"policy {msg.policy!r} cannot be sent to the sub-server processes "
                                f"({type(e).__name__}: {e}); make it picklable (cloudpickle) or run the "
                                f"sub-servers in threads with Router(..., processes=False)") from e
        with self._proc_lock:
            self._last_policy = (msg, blob)
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
        raise ValueError(f"ProcessTransport address must be 'ipc', 'tcp' or 'tcp://host:port', got {spec!r}")

    def _connect_address(self) -> str:
        addr = self.address
        for wild in ("tcp://0.0.0.0:", "tcp://*:"):
            if addr.startswith(wild):
                return "tcp://127.0.0.1:" + addr[len(wild):]
        return addr

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        if self._cores_dir is not None:
            shutil.rmtree(self._cores_dir, ignore_errors=True)
            self._cores_dir = None

    def _wake(self) -> None:
        with contextlib.suppress(OSError, TypeError):  # full pipe: the hub wakes anyway
            os.write(self._wake_w, b"x")

    def _running(self, model: str) -> bool:
        return model in self.procs and not self._ended(model)

    def _ended(self, model: str) -> bool:
        """Whether ``model``'s process has ended: its end of the spec channel closed (the process
        may have left a child of its own holding it), or its exit status arrived. A fork
        server's child is not this process's child: its status comes through the fork server,
        whose death also ends that pipe (status 255), so then the process id is checked."""
        chan = self._chans.get(model)
        if chan is not None and _readable(chan, 0.0):
            return True
        p = self.procs[model]
        with self._proc_lock:
            try:
                code = p.exitcode
            except ValueError:  # closed
                return True
        if code is None:
            return False
        return not (code == 255 and self.start_method == "forkserver" and p.pid is not None and _pid_runs(p.pid))

    def _close_chans(self) -> None:
        for chan in self._chans.values():
            with contextlib.suppress(OSError):
                chan.close()

    def _signal(self, model: str, sig: int) -> None:
        p = self.procs[model]
        if p.pid is not None and self._running(model):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, sig)

    def _kill_all(self) -> None:
        for name in self.procs:
            self._signal(name, signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        for name in self.procs:
            while self._running(name) and time.monotonic() < deadline:
                time.sleep(0.01)
            self._signal(name, signal.SIGKILL)
        for p in self.procs.values():
            p.join(2.0)

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
        why = self._dead_why.get(dest, f"sub-server process '{dest}' is not running")
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
            self._on_event(event)
        except Exception:  # noqa: BLE001 - never let an engine error kill the hub
            traceback.print_exc()

    def _on_result(self, frames: list[bytes]) -> None:
        """One `StepResult` of a sub-server: its messages go to the peers first (as bytes, one
        batch per peer), then its events to the engine. The hub handles one frame at a time, so
        no peer's reaction to the messages is handled before these events, and the engine's
        reply to them (a gated mode's `Go`) reaches a peer after the handoffs."""
        events, messages = split_result(frames)
        batches: dict[str, list[bytes]] = {}
        for dest, data in messages:
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
                self._errors.setdefault(src, f"sub-server process '{src}' sent an unknown frame kind {kind!r}")

    def _record_boot(self, name: str, data: bytes) -> None:
        now = time.perf_counter()
        try:
            b = json.loads(data)
            (t0, t1), (p0, p1) = self._t_launch[name], self._t_pickle[name]
            self.boot[name] = {"start": t1 - t0, "to_main": b["main"] - t0, "pickle": p1 - p0,
                               "transfer": b["received"] - max(b["main"], p1),
                               "unpickle": b["loaded"] - b["received"], "build": b["built"] - b["loaded"],
                               "connect": now - b["built"], "total": now - min(t0, p0),
                               "preloaded": bool(b["preloaded"]), "pid": b["pid"]}
        except (ValueError, KeyError, TypeError):  # a child of another version: no times
            self.boot[name] = {}

    def _on_death(self, name: str) -> None:
        import zmq
        deadline = time.monotonic() + 0.2  # collect the child's last words (events, error text)
        while time.monotonic() < deadline:
            if self._router.poll(20, zmq.POLLIN):
                self._recv_router()
            elif name in self._errors or self._closing:
                break
        p = self.procs[name]
        with self._proc_lock:
            p.join(1.0)
            code = p.exitcode
        held = self._buffer.pop(name, [])
        err = self._errors.get(name)
        text = f"sub-server process '{name}' died ({_exit_text(code)})" + (f": {err}" if err else "")
        self._dead_why[name] = text
        if not self._closing:
            self._emit(M.ModelDied(name, text, time.perf_counter()))
        self._dead.add(name)  # after the report: alive() turns False only once the engine knows why
        if not self._closing:
            self._bounce(name, held)

    def _hub_loop(self) -> None:
        import zmq
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        # a process's end: its spec channel closes, or its exit status arrives (checked, since a
        # fork server's death closes that pipe too), whichever comes first
        sentinels = {self._chans[name].fileno(): name for name in self.procs}
        sentinels.update({p.sentinel: name for name, p in self.procs.items()})
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        try:
            while not self._closed:
                self._drain_out()
                ready = dict(poller.poll(100))
                if self._router in ready:
                    self._recv_router()
                if self._wake_r in ready:
                    with contextlib.suppress(OSError):
                        while os.read(self._wake_r, 4096):
                            pass
                for fd, name in list(sentinels.items()):
                    if fd in ready and fd in sentinels:
                        ended = self._ended(name)
                        for other in [f for f, n in sentinels.items() if n == name and (ended or f == fd)]:
                            poller.unregister(other)
                            del sentinels[other]
                        if ended:
                            self._on_death(name)
            self._drain_out()
        except Exception as e:  # noqa: BLE001 - the hub is broken: fail everything, say why
            traceback.print_exc()
            if not self._closing:
                for name in self.procs:
                    self._dead.add(name)
                for name in self.procs:
                    self._emit(M.ModelDied(name, f"the sub-server message hub failed: {type(e).__name__}: {e}",
                                           time.perf_counter()))
        finally:
            if self._closed:
                with contextlib.suppress(Exception):
                    self._router.close(0)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _pid_runs(pid: int) -> bool:
    """Whether a process with this id runs (exists and is not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` turns readable (for a spec channel: its process ended) within
    ``timeout`` seconds; True for a closed socket."""
    if sock.fileno() < 0:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout * 1000.0))


def _with_context(e: BaseException, text: str) -> BaseException:
    """``e``'s type with ``text`` (falls back to RuntimeError for types that take other arguments)."""
    try:
        return type(e)(text)
    except Exception:  # noqa: BLE001
        return RuntimeError(text)
