"""Sub-servers in their own processes, talking over pyzmq (DESIGN.md, "Data flow").

`ProcessTransport` has the interface of `ThreadTransport` (``start``, ``send``, ``clock``,
``clock_for``, ``hold``, ``alive``, ``close``) and is the default when a `Router` holds two
or more torch models.

Layout::

    parent process                                  one child process per model (spawn)
      engine --send(model, msg)--> out queue          receiver thread: DEALER "i:<model>"
                                      |                   -> SubServer.inbox
      hub thread: ROUTER (ipc:// or tcp://) <-------> main thread: SubServer.run()
        - engine -> child messages (in send order)        send/emit: DEALER "o:<model>"
        - child -> child messages, forwarded as bytes
        - child -> engine events -> on_event(event)
        - child death (process sentinel) -> Finished(-1, model, "crashed", ...)

Ordering: every message passes through the hub thread, so messages from one sender to one
destination stay in order. What a sub-server sends its peers during a step (handoffs,
releases) is held by the hub until that step's ``StepDone`` arrives, then forwarded just before
the engine sees the ``StepDone``: the trace records a step before any step that reacts to it,
and a handoff reaches the peer before any ``Go`` the engine sends in reply (gated modes). What
the engine sends inside `hold` (one `Router.submit`) reaches each sub-server as one batch that
it handles whole before it next schedules.

Start-up: the per-model spec (runner with its model, tokenizer, scheduler settings) is the
child's `multiprocessing.Process` argument, pickled with cloudpickle (so classes defined in
``__main__`` or a notebook cell travel by value) plus torch's multiprocessing reductions, which
move CPU tensor storage into shared memory and pass its file descriptor: model weights (and the
zero-copy truncated small model, which shares modules with the large one) are mapped once, not
copied per process. The KV pool is not shared: the child allocates its own of the same shape and
this process's copy is released, so nothing here can write into a sub-server's KV. The child
does not re-import the parent's ``__main__`` script, so a script needs no
``if __name__ == "__main__"`` guard.

Serialisation: per-step messages and events are small dataclasses sent with plain pickle;
`RegisterPolicy` (and anything plain pickle refuses) goes with cloudpickle, so a `Policy`
class defined in a notebook cell works in the sub-server processes. Sender and receiver run the
same interpreter, never stored.

Timestamps: children stamp events with ``time.perf_counter`` (``CLOCK_MONOTONIC`` on Linux,
one clock for every process of the host), so their times and the engine's are comparable.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections import ChainMap
from typing import Callable

from ..policy import Policy
from . import messages as M
from .subserver import RegisterPolicy

_PROTO = pickle.HIGHEST_PROTOCOL
_SPAWN_LOCK = threading.Lock()


# ---- serialisation -------------------------------------------------------------------------
def dumps(msg) -> bytes:
    """Bytes of one message: plain pickle, cloudpickle for policies and whatever pickle refuses
    (e.g. policy state holding an object of a class defined in ``__main__``)."""
    if not isinstance(msg, RegisterPolicy):
        try:
            return pickle.dumps(msg, _PROTO)
        except Exception:  # noqa: BLE001 - fall back to pickling by value
            pass
    import cloudpickle
    return cloudpickle.dumps(msg, _PROTO)


def loads(data: bytes):
    return pickle.loads(data)


class _PolicyBytes:
    """`RegisterPolicy` on the wire: the policy cloudpickled inside a plain-pickled envelope,
    so a policy the child cannot load fails only the requests that use it."""

    def __init__(self, key: int, data: bytes, text: str):
        self.key, self.data, self.text = key, data, text

    def load(self, where: str) -> RegisterPolicy:
        try:
            return RegisterPolicy(self.key, pickle.loads(self.data))
        except Exception as e:  # noqa: BLE001
            hint = ""
            if isinstance(e, (ImportError, AttributeError)):
                hint = ("; its module cannot be imported there: install it, or call "
                        "cloudpickle.register_pickle_by_value(module) before a Router first uses the policy")
            return RegisterPolicy(self.key, _UnloadablePolicy(
                self.text, f"policy {self.text} could not be loaded in the sub-server process of model "
                           f"'{where}': {type(e).__name__}: {e}{hint}"))


class _UnloadablePolicy(Policy):
    """Stands in for a policy the child could not unpickle: every call raises, so the requests
    that use it fail with the load error and the others go on."""

    def __init__(self, text: str, error: str):
        self.text, self.error = text, error

    def __repr__(self) -> str:
        return self.text

    def route(self, step):
        raise RuntimeError(self.error)

    def route_batch(self, batch):
        raise RuntimeError(self.error)

    def send(self, req, target):
        raise RuntimeError(self.error)

    def receive(self, handoff, req):
        raise RuntimeError(self.error)


class _LoadError:
    """Stands in for a spec the child could not unpickle; the child reports ``text``."""

    def __init__(self, text: str):
        self.text = text


def _load_spec(data: bytes):
    try:
        return pickle.loads(data)
    except BaseException as e:  # noqa: BLE001 - reported by the child through the hub
        return _LoadError(f"could not load the sub-server spec in the child process: {type(e).__name__}: {e}\n"
                          + traceback.format_exc())


class _Spec:
    """A sub-server spec on its way into a child process (a `Process` argument).

    Pickled (inside `Process.start`, while the spawning popen is set) with cloudpickle plus
    torch's multiprocessing reductions: tensors travel as shared-memory file descriptors."""

    def __init__(self, spec: dict):
        self.spec = spec

    def __reduce__(self):
        import cloudpickle
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers the tensor/storage reductions

        class TorchCloudPickler(cloudpickle.CloudPickler):
            dispatch_table = ChainMap(ForkingPickler._extra_reducers, cloudpickle.CloudPickler.dispatch_table)

        buf = io.BytesIO()
        TorchCloudPickler(buf, protocol=_PROTO).dump(self.spec)
        return _load_spec, (buf.getvalue(),)


class _FreshPool:
    """A `KVPool` of the same shape, allocated in the child: the KV cache is the sub-server's
    private memory, not shared with this process."""

    def __init__(self, pool):
        layers, slots, heads, dim = pool.k.shape
        self.args = (layers, heads, dim, pool.num_blocks, pool.block_size, pool.k.dtype, str(pool.k.device))

    def __reduce__(self):
        from .kv_pool import KVPool
        return KVPool, self.args


def _child_spec(spec: dict) -> dict:
    """The spec as the child gets it: the runner (model shared through shared memory) with a
    fresh KV pool of the same shape instead of this process's."""
    import copy

    from .kv_pool import KVPool
    spec = dict(spec)
    runner = spec.get("runner")
    if isinstance(getattr(runner, "pool", None), KVPool) and runner.pool.k is not None:
        runner = copy.copy(runner)
        runner.pool = _FreshPool(runner.pool)
        spec["runner"] = runner
    return spec


@contextlib.contextmanager
def _no_main_reimport():
    """Spawn children without re-running the parent's ``__main__`` script: everything the child
    needs arrives pickled by value, and a script without a ``__main__`` guard must not build a
    second Router inside each child."""
    import multiprocessing.spawn as spawn
    orig = spawn.get_preparation_data

    def prep(name):
        d = orig(name)
        d.pop("init_main_from_path", None)
        d.pop("init_main_from_name", None)
        return d

    with _SPAWN_LOCK:
        spawn.get_preparation_data = prep
        try:
            yield
        finally:
            spawn.get_preparation_data = orig


# ---- the child -----------------------------------------------------------------------------
def _prepare_runner(runner) -> None:
    """Per-process setup a runner needs after unpickling (registries are per process)."""
    from ..backends.torch_runner import TorchRunner, register_attention
    if isinstance(runner, TorchRunner):
        register_attention()


def _child_main(name: str, spec, address: str, threads: int) -> None:
    """Entry point of a sub-server process: build the `SubServer`, serve until `Shutdown`."""
    import sys

    import torch
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it closes us
    torch.set_num_threads(max(1, int(threads)))
    ctx = zmq.Context()
    out = ctx.socket(zmq.DEALER)
    out.setsockopt(zmq.IDENTITY, b"o:" + name.encode())
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(address)
    out_lock = threading.Lock()  # only the main thread sends today; cheap insurance

    in_step = [False]

    def send(model: str, msg) -> None:
        data = dumps(msg)
        with out_lock:  # "ts": sent during a step, released by the hub with that step's StepDone
            out.send_multipart([b"ts" if in_step[0] else b"to", model.encode(), data])

    def emit(event) -> None:
        data = dumps(event)
        with out_lock:
            out.send_multipart([b"ev", b"", data])

    stop, orphaned = threading.Event(), threading.Event()
    fatal: list[str] = []
    code = 0
    rx = None
    try:
        if isinstance(spec, _LoadError):
            raise RuntimeError(spec.text)
        from .subserver import SubServer
        _prepare_runner(spec["runner"])
        ss = SubServer(**spec, send=send, emit=emit, clock=time.perf_counter)
        step = ss.step

        def marked_step(*args, **kwargs):
            in_step[0] = True
            try:
                return step(*args, **kwargs)
            finally:
                in_step[0] = False

        ss.step = marked_step
        rx = threading.Thread(target=_child_receive, args=(ctx, address, name, ss.inbox, stop, fatal, orphaned),
                              name=f"tokenrouter-{name}-rx", daemon=True)
        rx.start()
        ss.run()
        if fatal:
            raise RuntimeError(fatal[0])
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the requests
        code = 1
        text = f"sub-server '{name}' crashed: {type(e).__name__}: {e}"
        if isinstance(spec, _LoadError) or fatal:
            text = str(e)
        with contextlib.suppress(Exception), out_lock:
            out.send_multipart([b"err", b"", text.encode(errors="replace")])
        traceback.print_exc()
    finally:
        stop.set()
        if rx is not None:
            rx.join(5.0)
        out.close(linger=0 if orphaned.is_set() else 2000)  # flush the last events, unless nobody listens
        ctx.term()
    # skip the interpreter's teardown of torch and transformers (seconds, nothing to save)
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(code)


def _child_receive(ctx, address: str, name: str, inbox, stop: threading.Event, fatal: list,
                   orphaned: threading.Event) -> None:
    """Receiver thread of a child: hub messages -> ``inbox``; Shutdown also when the parent dies."""
    import multiprocessing

    import zmq
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"i:" + name.encode())
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    sock.send_multipart([b"hi", b"", b""])
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        poller.register(parent.sentinel, zmq.POLLIN)
    try:
        while not stop.is_set():
            ready = dict(poller.poll(200))
            if sock in ready:
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msgs, last = [], False
                    for frame in frames:  # one batch from the hub: it reaches the inbox at once
                        try:
                            msg = loads(frame)
                        except Exception as e:  # noqa: BLE001 - cannot go on without it: stop, say why
                            fatal.append(f"sub-server '{name}' could not load a message from the engine: "
                                         f"{type(e).__name__}: {e}")
                            msg = M.Shutdown()
                        if isinstance(msg, _PolicyBytes):
                            msg = msg.load(name)
                        msgs.append(msg)
                        if isinstance(msg, M.Shutdown):
                            last = True
                            break
                    _put_all(inbox, msgs)
                    if last:
                        return
            if parent is not None and parent.sentinel in ready:  # the parent is gone: stop serving
                orphaned.set()
                inbox.put(M.Shutdown())
                if address.startswith("ipc://"):  # nobody else will remove the hub's folder
                    shutil.rmtree(os.path.dirname(address[len("ipc://"):]), ignore_errors=True)
                t = threading.Timer(5.0, os._exit, args=(0,))  # if a forward never returns
                t.daemon = True
                t.start()
                return
    except zmq.ContextTerminated:
        pass
    finally:
        sock.close(linger=0)


def _put_all(q, items: list) -> None:
    """Append ``items`` to an unbounded `queue.Queue` in one step, so its consumer sees the
    whole batch (e.g. all admissions of one `Router.submit`) before it next schedules."""
    with q.mutex:
        q.queue.extend(items)
        q.unfinished_tasks += len(items)
        q.not_empty.notify()


# ---- the parent ----------------------------------------------------------------------------
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
    """Each sub-server in its own process (spawn); messages over pyzmq through a hub thread.

    Args:
        threads: torch intra-op threads per sub-server process (default: the CPUs this process
            may use divided by the number of models, at least 1).
        address: ``"ipc"`` (default: a Unix socket in a fresh temporary folder, removed on
            close), ``"tcp"`` (``tcp://127.0.0.1`` on a random free port), or a full
            ``"tcp://host:port"`` to bind (children connect to it; ``*``/``0.0.0.0`` become
            127.0.0.1 for them).
        start_timeout: seconds `start` waits for every process to boot and connect (a fresh
            interpreter importing torch and transformers: seconds); None returns at once and
            messages wait in the hub until their process connects (the first requests' latency
            then includes the boot).
        close_timeout: seconds `close` waits for each process to end before terminating it.

    Not provided: ``subservers`` (the sub-servers live in other processes), so
    `Engine.idle` checks only the engine's own counters.
    """

    clock = staticmethod(time.perf_counter)

    def __init__(self, threads: int | None = None, address: str = "ipc", start_timeout: float | None = 600.0,
                 close_timeout: float = 5.0):
        self.threads = threads
        self.address_spec = address
        self.start_timeout = start_timeout
        self.close_timeout = close_timeout
        self.address: str | None = None
        self.procs: dict = {}
        self._ctx = None
        self._router = None
        self._ipc_dir: str | None = None
        self._out: collections.deque = collections.deque()
        self._wake_r = self._wake_w = None
        self._hub: threading.Thread | None = None
        self._on_event: Callable[[object], None] | None = None
        self._ready: set[str] = set()
        self._dead: set[str] = set()
        self._errors: dict[str, str] = {}
        self._buffer: dict[str, list[bytes]] = collections.defaultdict(list)
        self._proc_lock = threading.Lock()
        self._policy_cache: dict[int, tuple[object, bytes]] = {}
        self._closing = False
        self._closed = False
        self._started = False
        self._hold_lock = threading.Lock()
        self._holding = 0
        self._held: dict[str, list[tuple[str, bytes]]] = {}

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
        if isinstance(msg, RegisterPolicy):
            data = self._policy_bytes(msg)
        else:
            data = dumps(msg)
        self._out.append((model, data))
        if threading.current_thread() is not self._hub:
            self._wake()

    def start(self, specs: dict, on_event: Callable[[object], None]) -> None:
        """Bind the hub, spawn one process per spec (its `SubServer` keyword arguments, less
        send/emit/clock), start the hub thread and wait until every process has connected
        (``start_timeout``).

        Raises:
            RuntimeError: a process died while starting (its error and exit code are in the
                message) or did not connect in time; every process is ended first.
        """
        import torch.multiprocessing as tmp
        import zmq
        if self._started:
            raise RuntimeError("ProcessTransport.start was called twice")
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
        n = len(specs)
        threads = self.threads or max(1, _cpus() // max(1, n))
        mp = tmp.get_context("spawn")
        try:
            with _no_main_reimport():
                for name, spec in specs.items():
                    p = mp.Process(target=_child_main,
                                   args=(name, _Spec(_child_spec(spec)), self._connect_address(), threads),
                                   name=f"tokenrouter-{name}", daemon=True)
                    try:
                        p.start()
                    except Exception as e:
                        raise type(e)(f"could not start the sub-server process of model '{name}': {e}; "
                                      f"Router(..., processes=False) runs sub-servers in threads") from e
                    self.procs[name] = p
        except BaseException:
            self._closed = True
            self._kill_all()
            self._router.close(0)
            self._ctx.term()
            self._remove_ipc_dir()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self._hub = threading.Thread(target=self._hub_loop, name="tokenrouter-hub", daemon=True)
        self._hub.start()
        for spec in specs.values():  # each child has its own KV pool: free this process's copy
            pool = getattr(spec.get("runner"), "pool", None)
            if pool is not None and hasattr(pool, "release"):
                pool.release()
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

    def alive(self, model: str) -> bool:
        """Whether the model's process serves. The hub watches every process and reports a
        death (with its exit code) before this turns False, so the engine's own liveness check
        never races ahead of that message."""
        p = self.procs.get(model)
        if p is None or model in self._dead or self._closed:
            return False
        if self._hub is not None and self._hub.is_alive():
            return True
        with self._proc_lock:
            return p.is_alive()

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
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
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
        for p in self.procs.values():
            with contextlib.suppress(Exception):
                p.close()

    # -- internals ------------------------------------------------------------------------
    def _policy_bytes(self, msg: RegisterPolicy) -> bytes:
        hit = self._policy_cache.get(msg.key)
        if hit is not None and hit[0] is msg.policy:
            return hit[1]
        try:
            import cloudpickle
            data = pickle.dumps(_PolicyBytes(msg.key, cloudpickle.dumps(msg.policy, _PROTO), repr(msg.policy)), _PROTO)
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"policy {msg.policy!r} cannot be sent to the sub-server processes "
                            f"({type(e).__name__}: {e}); make it picklable (cloudpickle) or run the "
                            f"sub-servers in threads with Router(..., processes=False)") from e
        self._policy_cache[msg.key] = (msg.policy, data)
        return data

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

    def _wake(self) -> None:
        with contextlib.suppress(OSError, TypeError):  # full pipe: the hub wakes anyway
            os.write(self._wake_w, b"x")

    def _kill_all(self) -> None:
        for p in self.procs.values():
            with self._proc_lock:
                if p.is_alive():
                    p.terminate()
        for p in self.procs.values():
            p.join(2.0)
            with self._proc_lock:
                if p.is_alive():
                    p.kill()
            p.join(2.0)

    def _deliver(self, dest: str, datas: list[bytes]) -> None:
        """Send messages to ``dest`` as one multipart message (one batch for its inbox)."""
        import zmq
        if dest in self._dead or dest not in self.procs or not datas:
            return
        if dest not in self._ready:
            self._buffer[dest].extend(datas)
            return
        try:
            self._router.send_multipart([b"i:" + dest.encode(), *datas])
        except zmq.ZMQError:  # the peer is gone (ROUTER_MANDATORY): its death is reported separately
            pass

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

    def _release_held(self, src: str) -> None:
        """Forward what ``src`` sent its peers during the step whose StepDone just arrived: the
        engine records that step before any peer can react to it (a causal trace), and the
        handoffs reach the peers before any `Go` the engine sends in reply."""
        batches: dict[str, list[bytes]] = {}
        for dest, data in self._held.pop(src, []):
            batches.setdefault(dest, []).append(data)
        for dest, datas in batches.items():
            self._deliver(dest, datas)

    def _emit(self, event) -> None:
        try:
            self._on_event(event)
        except Exception:  # noqa: BLE001 - never let an engine error kill the hub
            traceback.print_exc()

    def _recv_router(self) -> bool:
        """Handle every message waiting on the ROUTER; True if any."""
        import zmq
        got = False
        while True:
            try:
                ident, kind, dest, data = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return got
            got = True
            self._drain_out()
            src = ident.decode()[2:]
            if kind == b"to":
                self._deliver(dest.decode(), [data])
            elif kind == b"ts":
                self._held.setdefault(src, []).append((dest.decode(), data))
            elif kind == b"ev":
                ev = loads(data)
                if isinstance(ev, M.StepDone):
                    self._release_held(src)
                self._emit(ev)
                self._drain_out()
            elif kind == b"hi":
                self._ready.add(src)
                self._deliver(src, self._buffer.pop(src, []))
            elif kind == b"err":
                self._errors[src] = data.decode(errors="replace")

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
        self._buffer.pop(name, None)
        self._held.pop(name, None)
        if not self._closing:
            err = self._errors.get(name)
            text = f"sub-server process '{name}' died ({_exit_text(code)})" + (f": {err}" if err else "")
            self._emit(M.Finished(-1, name, "crashed", text, 0.0))
        self._dead.add(name)  # after the report: alive() turns False only once the engine knows why

    def _hub_loop(self) -> None:
        import zmq
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        sentinels = {p.sentinel: name for name, p in self.procs.items()}
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
                    if fd in ready:
                        poller.unregister(fd)
                        del sentinels[fd]
                        self._on_death(name)
            self._drain_out()
        except Exception as e:  # noqa: BLE001 - the hub is broken: fail everything, say why
            traceback.print_exc()
            if not self._closing:
                for name in self.procs:
                    self._dead.add(name)
                self._emit(M.Finished(-1, next(iter(self.procs)), "crashed",
                                      f"the sub-server message hub failed: {type(e).__name__}: {e}", 0.0))
        finally:
            if self._closed:
                with contextlib.suppress(Exception):
                    self._router.close(0)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
