"""The sub-server process: its entry point (`_child_main`) and its receiver thread.

Receives its spec over the spec channel (`wire.recv_spec`), builds a `SubServer` from it
(`build_subserver`) and serves it (`serve_loop.serve`): each `StepResult` goes to the hub as one
``Frame.RESULT`` (`wire.encode_result`). A receiver thread turns hub messages into the inbox
(one hub batch at once), and stops the sub-server when the parent process dies. The first
frame to the hub (``Frame.HELLO``) carries the process's start-up times (`ProcessTransport.boot`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import threading
import time
import traceback

from .. import messages
from ..core.serve_loop import serve
from ..core.subserver import SubServer
from ..runner import RunnerInfo, RunnerSpec
from .codec import Frame, PolicyBlob, decode, encode_result
from .wire import _LoadError, load_policy, load_spec, recv_spec

_IMPORTED_IN = os.getpid()  # another pid in a sub-server: this module came with a fork server's fork


def _prepare_runner(runner) -> None:
    """Per-process setup a runner needs after unpickling (e.g. registries, which are per
    process): its optional ``prepare_process()``."""
    prepare = getattr(runner, "prepare_process", None)
    if prepare is not None:
        prepare()


def build_subserver(spec: dict) -> SubServer:
    """The `SubServer` of a received spec (its keyword arguments, as `ProcessTransport.start`
    sends them); its clock is ``time.perf_counter``. A `RunnerSpec` is built here (the runner
    and its KV pool are made in this process); a runner object gets its per-process setup. A
    host of sub-servers other than this module's process (e.g. a Ray actor that got the spec
    by another route) builds it the same way and serves it with `serve_loop.serve`.

    Raises:
        whatever building the runner raises (e.g. out of memory for its KV pool).
    """
    runner = spec["runner"]
    if isinstance(runner, RunnerSpec):
        spec = dict(spec, runner=runner.build())
    else:
        _prepare_runner(runner)
    return SubServer(**spec, clock=time.perf_counter)


def _child_main(name: str, address: str, threads: int, channel, cores=None) -> None:
    """Entry point of a sub-server process: receive the spec over ``channel`` (a Unix socket;
    kept open while this process lives, so the parent sees its end close when this process
    ends), build the `SubServer`, serve until `Shutdown`. ``cores``: its `CoreShare` (core
    lending), or None for a fixed ``threads``."""
    import sys

    t_main = time.perf_counter()
    preloaded = _IMPORTED_IN != os.getpid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it closes us

    def receive():
        data, fds = recv_spec(channel)
        return data, fds

    code = run_subserver(name, address, threads, receive, load_spec, t_main=t_main, preloaded=preloaded, cores=cores)
    # skip the interpreter's teardown of torch and transformers (seconds, nothing to save)
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(code)


def lend_between_layers(runner, cores) -> None:
    """Give ``runner`` core lending's call between two layers of a step (``between_layers``:
    `CoreShare.give_back`) where cores can move between models (`CoreShare.lends`); a model
    alone, or on one core, gets none, so its steps run without a stop between layers."""
    if cores is not None and cores.lends and hasattr(runner, "between_layers"):
        runner.between_layers = cores.give_back


def run_subserver(
    name: str,
    address: str,
    threads: int,
    receive,
    load,
    *,
    t_main: float,
    preloaded: bool = False,
    watch_parent: bool = True,
    cores=None,
) -> int:
    """Run model ``name``'s sub-server until `Shutdown`: get its spec (``receive()`` -> data,
    ``load(*data)`` -> the spec dict or a `_LoadError`), connect to the hub at ``address``, build
    the `SubServer` (`build_subserver`) and serve it (`serve_loop.serve`). Returns the exit code
    (0: shut down, 1: crashed, reported to the hub as ``Frame.ERROR``). ``watch_parent``: also stop when the parent
    process ends (for a
    process started by `ProcessTransport`; a Ray actor ends with its owner instead). ``cores``:
    a `tokenrouter_sdk.engine.transports.cores.CoreShare`: the thread count follows it step by step."""
    import torch
    import zmq

    torch.set_num_threads(max(1, int(threads)))
    ctx = zmq.Context()
    out = ctx.socket(zmq.DEALER)
    out.setsockopt(zmq.IDENTITY, b"o:" + name.encode())
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(address)
    out_lock = threading.Lock()  # the main thread is the only sender; the lock keeps any second sender safe

    def deliver(res) -> None:
        with out_lock:
            out.send_multipart(encode_result(res))

    stop, orphaned = threading.Event(), threading.Event()
    fatal: list[str] = []
    code = 0
    rx = None
    spec = None
    inbox: queue.Queue = queue.Queue()
    try:
        got = receive()
        t_received = time.perf_counter()
        spec = load(*got)
        del got
        t_loaded = time.perf_counter()
        if isinstance(spec, _LoadError):
            raise RuntimeError(spec.text)
        subserver = build_subserver(spec)
        lend_between_layers(subserver.runner, cores)
        boot = {
            "pid": os.getpid(),
            "preloaded": preloaded,
            "main": t_main,
            "received": t_received,
            "loaded": t_loaded,
            "built": time.perf_counter(),
            "runner": RunnerInfo.of(subserver.runner).geometry(),
        }
        rx = threading.Thread(
            target=_child_receive,
            args=(ctx, address, name, inbox, stop, fatal, orphaned, boot, watch_parent),
            name=f"tokenrouter-{name}-rx",
            daemon=True,
        )
        rx.start()
        serve(subserver, inbox, deliver, cores=cores)
        if fatal:
            raise RuntimeError(fatal[0])
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the requests
        code = 1
        text = f"sub-server '{name}' crashed: {type(e).__name__}: {e}"
        if isinstance(spec, _LoadError) or fatal:
            text = str(e)
        with contextlib.suppress(Exception), out_lock:
            out.send_multipart([Frame.ERROR.value, text.encode(errors="replace")])
        traceback.print_exc()
    finally:
        stop.set()
        if cores is not None:
            with contextlib.suppress(Exception):
                cores.idle()
                cores.close()
        if rx is not None:
            rx.join(5.0)
        out.close(linger=0 if orphaned.is_set() else 2000)  # flush the last events, unless nobody listens
        ctx.term()
    return code


def _child_receive(
    ctx,
    address: str,
    name: str,
    inbox,
    stop: threading.Event,
    fatal: list,
    orphaned: threading.Event,
    boot: dict | None = None,
    watch_parent: bool = True,
) -> None:
    """Receiver thread of a child: says ``hi`` (with ``boot``, start-up times, and ``now``, this
    process's clock as it sends, as JSON), then hub messages -> ``inbox``; Shutdown also when
    the parent dies (``watch_parent``)."""
    import multiprocessing

    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"i:" + name.encode())
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    sock.send_multipart([Frame.HELLO.value, json.dumps(dict(boot or {}, now=time.perf_counter())).encode()])
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    parent = multiprocessing.parent_process() if watch_parent else None
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
                            msg = decode(frame)
                        except Exception as e:  # noqa: BLE001 - cannot go on without it: stop, say why
                            fatal.append(
                                f"sub-server '{name}' could not load a message from the engine: {type(e).__name__}: {e}"
                            )
                            msg = messages.Shutdown()
                        if isinstance(msg, PolicyBlob):
                            msg = load_policy(msg, name)
                        msgs.append(msg)
                        if isinstance(msg, messages.Shutdown):
                            last = True
                            break
                    _put_all(inbox, msgs)
                    if last:
                        return
            if parent is not None and parent.sentinel in ready:  # the parent is gone: stop serving
                orphaned.set()
                inbox.put(messages.Shutdown())
                if address.startswith("ipc://"):  # nobody else will remove the hub's folder
                    shutil.rmtree(os.path.dirname(address[len("ipc://") :]), ignore_errors=True)
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
