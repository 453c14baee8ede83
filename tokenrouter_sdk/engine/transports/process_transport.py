"""Sub-servers in their own processes on this machine: `ProcessTransport`, the default when a
`Router` holds torch models, and its `ProcessLauncher`.

The data path (the pyzmq hub, ordering, serialisation) is `tokenrouter_sdk.engine.transports.hub`'s; this
module starts, watches and ends the processes. The child's side lives in `process_child`, the
spec's serialisation in `wire`.

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

Timestamps: children stamp events with ``time.perf_counter`` (``CLOCK_MONOTONIC`` on Linux,
one clock for every process of the host), so their times and the engine's are comparable.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Callable

from . import fd_limit, process_start
from .cores import CoreShare, create_flags
from .hub import HubTransport, Started, boot_record
from .process_child import _child_main
from .wire import _child_spec, dump_spec, pack_shared, send_spec

FDS_PER_MODEL = 8  # descriptors a sub-server process costs this process at most: spec channel, sentinel,
#                    hub connections, its weights' shared-memory segments (usually one)
FDS_PER_HUB = 16  # the hub: zmq context and socket, wake pipe


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


class LocalProcess:
    """One sub-server process as the hub watches it (`hub.Started`): its
    `multiprocessing.Process` and this end of its spec channel, which turns readable when the
    process ends.

    Args:
        proc: the started process.
        chan: this end of its spec channel.
        forkserver: whether it was forked by the fork server (its exit status then comes through
            the fork server, whose death also ends that pipe with status 255).
    """

    def __init__(self, proc, chan: socket.socket, forkserver: bool):
        self.proc, self.chan, self._forkserver = proc, chan, forkserver
        self.pid = proc.pid
        self._lock = threading.Lock()

    @property
    def exitcode(self) -> int | None:
        with self._lock:
            return self.proc.exitcode

    def sentinels(self) -> list:
        return [self.chan, self.proc.sentinel]

    def ended(self) -> bool:
        """Whether the process has ended: its end of the spec channel closed (the process may
        have left a child of its own holding it), or its exit status arrived (for a fork
        server's child with status 255, its process id no longer runs)."""
        if _readable(self.chan, 0.0):
            return True
        with self._lock:
            try:
                code = self.proc.exitcode
            except ValueError:  # closed
                return True
        if code is None:
            return False
        return not (code == 255 and self._forkserver and self.pid is not None and _pid_runs(self.pid))

    def signal(self, sig: int) -> None:
        if self.pid is not None and not self.ended():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def join(self, timeout: float | None = None) -> None:
        with self._lock:
            self.proc.join(timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.chan.close()
        with contextlib.suppress(Exception):
            self.proc.close()


class ProcessLauncher:
    """Starts each sub-server in a process of this machine (`hub.Launcher`).

    Args:
        threads: torch threads per process, fixed; None: core lending (see `ProcessTransport`).
        start_method: ``"forkserver"``, ``"spawn"``, or None: chosen by `prepare`
            (`process_start.default_start_method`).
        start_timeout: seconds sending a process its spec may block.

    Attributes:
        kind: the start method (set by `prepare` when None).
        threads: torch threads each process runs with (set by `prepare`).
        shared: what `prepare` moved into shared memory (`wire.pack_shared`).
        cores_dir: the folder of the core-lending flags (None without lending; removed by
            `close`).
        launched, pickled: model -> when starting its process / pickling its spec began and
            ended (`time.perf_counter` seconds).
    """

    what = "sub-server processes"

    def __init__(
        self, threads: int | None = None, start_method: str | None = None, start_timeout: float | None = 600.0
    ):
        if start_method is not None and start_method not in process_start.START_METHODS:
            raise ValueError(
                f"ProcessTransport start_method must be one of {process_start.START_METHODS}, got {start_method!r}"
            )
        self.fixed_threads = threads
        self.kind = start_method
        self.threads: int | None = None
        self.start_timeout = start_timeout
        self.shared: dict = {}
        self.cores_dir: str | None = None
        self.launched: dict[str, tuple[float, float]] = {}
        self.pickled: dict[str, tuple[float, float]] = {}
        self._mp = None
        self._shares: dict = {}
        self._payloads: dict[str, tuple[bytes, list[int]]] = {}
        self._chans: dict[str, socket.socket] = {}
        self._what = "the sub-server processes"

    def prepare(self, specs: dict) -> str | None:
        """Make room for the processes' descriptors, move the weights into shared memory, choose
        the start method and threads, and (with the fork server, which imports meanwhile) pickle
        the specs.

        Raises:
            OSError (EMFILE): too few open files even after raising the soft limit to the hard
                one (names ``ulimit -n`` and the numbers).
            ValueError: the start method is not available on this platform.
            Exception: a spec cannot be pickled (names the model).
        """
        self._what = f"the sub-server processes of {len(specs)} model(s)"
        fd_limit.ensure_room(FDS_PER_MODEL * len(specs) + FDS_PER_HUB, self._what)
        try:  # the weights into a few shared-memory segments: a handful of descriptors per model
            self.shared = pack_shared([_child_spec(spec).get("runner") for spec in specs.values()])
        except Exception as e:  # noqa: BLE001 - packing is an optimisation: per-storage sharing still works
            err = fd_limit.too_many_files(e, self._what)
            if err is not e:
                raise err from e
            self.shared = {"error": f"{type(e).__name__}: {e}"}
        self.kind = self.kind or process_start.default_start_method(specs)
        self._mp = process_start.get_context(self.kind, specs)
        n = len(specs)
        self.threads = self.fixed_threads or max(1, _cpus() // max(1, n))
        if self.fixed_threads is None and n > 1:
            self._shares = self._core_shares(list(specs))
        if self.kind == "forkserver":  # the fork server imports while this process pickles
            process_start.prestart(self.kind)
            self._payloads = {name: self._pickle(name, spec) for name, spec in specs.items()}
        return None

    def launch(
        self, specs: dict, address: str, report: Callable[[str, str], None], started: dict[str, Started]
    ) -> None:
        """Start one process per model, each with one end of a new spec channel."""
        with process_start.no_main_reimport():
            for name in specs:
                mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                self._chans[name] = mine
                p = self._mp.Process(
                    target=_child_main,
                    args=(name, address, self.threads, theirs, self._shares.get(name)),
                    name=f"tokenrouter-{name}",
                    daemon=True,
                )
                t0 = time.perf_counter()
                try:
                    p.start()
                except Exception as e:
                    mine.close()
                    raise _with_context(
                        e,
                        f"could not start the sub-server process of model '{name}': {e}; "
                        f"Router(..., processes=False) runs sub-servers in threads",
                    ) from e
                finally:
                    theirs.close()
                self.launched[name] = (t0, time.perf_counter())
                started[name] = LocalProcess(p, mine, self.kind == "forkserver")

    def deliver(self, specs: dict) -> None:
        """Send each process its pickled spec over its channel (a process already gone: the hub
        reports why)."""
        for name, spec in specs.items():
            data, fds = self._payloads.pop(name) if name in self._payloads else self._pickle(name, spec)
            chan = self._chans[name]
            chan.settimeout(self.start_timeout)
            with contextlib.suppress(OSError):
                send_spec(chan, data, fds)
            chan.settimeout(None)
            del data, fds

    def boot(self, model: str, hello: dict, now: float) -> dict:
        return boot_record(hello, self.launched[model], self.pickled[model], now)

    def adjust(self, event):
        return event  # one host: one clock

    def kill_all(self, started: dict[str, Started]) -> None:
        """SIGTERM every running process, SIGKILL what still runs 2 s later, then reap."""
        for p in started.values():
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        for p in started.values():
            while not p.ended() and time.monotonic() < deadline:
                time.sleep(0.01)
            p.signal(signal.SIGKILL)
        for p in started.values():
            with contextlib.suppress(Exception):
                p.join(2.0)

    def close(self) -> None:
        """Remove the core-lending folder and drop the pickled specs not sent."""
        self._payloads.clear()
        if self.cores_dir is not None:
            shutil.rmtree(self.cores_dir, ignore_errors=True)
            self.cores_dir = None

    def start_error(self, e: BaseException) -> BaseException:
        return fd_limit.too_many_files(e, self._what)

    def _core_shares(self, names: list[str]) -> dict:
        """Per model, its `CoreShare` of this machine's cores (core lending, see
        `tokenrouter_sdk.engine.transports.cores`), over a flags file in a fresh folder removed at `close`."""
        self.cores_dir = tempfile.mkdtemp(prefix="tokenrouter-cores-")
        path = os.path.join(self.cores_dir, "busy")
        create_flags(path, len(names))
        return {name: CoreShare(path, i, len(names), _cpus()) for i, name in enumerate(names)}

    def _pickle(self, name: str, spec: dict) -> tuple[bytes, list[int]]:
        t0 = time.perf_counter()
        try:
            out = dump_spec(_child_spec(spec))
        except Exception as e:
            raise _with_context(
                e,
                f"the sub-server spec of model '{name}' cannot be sent to its process "
                f"({type(e).__name__}: {e}); Router(..., processes=False) runs "
                f"sub-servers in threads",
            ) from e
        self.pickled[name] = (t0, time.perf_counter())
        _release_pool(spec)
        return out


class ProcessTransport(HubTransport):
    """Each sub-server in its own process of this machine (a `HubTransport` with a
    `ProcessLauncher`).

    Args:
        threads: torch intra-op threads per sub-server process, fixed. Default (None): core
            lending (`tokenrouter_sdk.engine.transports.cores`): before each step a process takes the CPUs
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
            `tokenrouter_sdk.engine.transports.process_start`.

    Raises:
        ValueError: an unknown ``start_method``.

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
        launcher: its `ProcessLauncher` (``shared``, ``cores_dir``).
    """

    def __init__(
        self,
        threads: int | None = None,
        address: str = "ipc",
        start_timeout: float | None = 600.0,
        close_timeout: float = 5.0,
        start_method: str | None = None,
    ):
        super().__init__(
            ProcessLauncher(threads, start_method, start_timeout),
            address=address,
            start_timeout=start_timeout,
            close_timeout=close_timeout,
        )


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
