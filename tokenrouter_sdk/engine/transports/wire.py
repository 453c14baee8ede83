"""What travels between the engine and sub-server processes (`ProcessTransport`).

Per-step messages and events travel with the typed codec of `codec`; a policy travels
cloudpickled in a `codec.PolicyBlob` (`policy_blob` / `load_policy`), so a `Policy` class
defined in a notebook cell reaches the sub-server processes.

The start-up spec (the runner's `RunnerSpec` with its model, or a runner object given as one;
tokenizer, settings) is pickled by `dump_spec` with
cloudpickle plus torch's multiprocessing reductions, so model weights are mapped by every
process, not copied. First `pack_shared` moves the CPU tensors the specs hold into a few
shared-memory segments (storages side by side, at most `SEGMENT_BYTES` each; a larger storage
gets a segment of its own) and points each tensor at its place there; then every tensor travels
as a view of its segment, and a segment as one file descriptor. A model therefore costs a
handful of descriptors in every process (one per segment), not one per weight tensor (about 300
for a 30-layer model: three model pairs would pass the common limit of 1,024 open files).
Segments are made once: tensors already in shared memory (a second Router over the same models)
are left where they are. The descriptors and the bytes go over a Unix socket pair (`send_spec` /
`recv_spec`, SCM_RIGHTS in chunks), not through the process launcher. A runner spec is built in
the child, KV pool included; a runner object's KV pool is re-allocated there (`_FreshPool`).
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import struct
import threading
import traceback
from collections import ChainMap

from ...policy import Policy
from ..messages import RegisterPolicy
from .codec import PolicyBlob

_PROTO = pickle.HIGHEST_PROTOCOL

DYNAMIC = "<dynamic-code>"  # the file name cloudpickle gives code it pickles by value


def _functions(cls) -> dict:
    """``qualname -> function`` of the functions defined on ``cls`` (methods, static and class
    methods, property accessors)."""
    out = {}
    for v in vars(cls).values():
        for f in (v, getattr(v, "__func__", None), getattr(v, "fget", None), getattr(v, "fset", None)):
            if hasattr(f, "__code__") and hasattr(f, "__qualname__"):
                out[f.__qualname__] = f
    return out


def policy_sources(policy) -> dict:
    """Where the policy's code lives, for the child to name it in tracebacks: ``qualname ->
    (file name, the file's lines as ``linecache`` holds them, or None)`` for every function of the
    policy's classes (a notebook cell's "file" is only in this process's ``linecache``)."""
    import linecache

    out = {}
    for cls in type(policy).__mro__:
        if cls.__module__.startswith(("tokenrouter_sdk", "builtins")):
            continue
        for name, f in _functions(cls).items():
            fn = f.__code__.co_filename
            lines = linecache.cache.get(fn)
            out[name] = (fn, lines)
    return out


def _rename_code(code, filename: str):
    consts = tuple(_rename_code(c, filename) if hasattr(c, "co_filename") else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def restore_sources(policy, sources: dict) -> None:
    """Give the unpickled policy's code back its file names and register the files' lines in
    ``linecache``, so an error in it names the cell or file and shows the line (see
    `policy_sources`)."""
    import linecache

    for cls in type(policy).__mro__:
        for name, f in _functions(cls).items():
            hit = sources.get(name)
            if hit is None or f.__code__.co_filename != DYNAMIC:
                continue
            fn, lines = hit
            f.__code__ = _rename_code(f.__code__, fn)
            if lines is not None:
                linecache.cache.setdefault(fn, tuple(lines))


def policy_blob(key: int, policy) -> PolicyBlob:
    """``policy`` for the wire: cloudpickled (so a class defined in ``__main__`` or a notebook
    cell travels by value), with its repr and where its code lives (`policy_sources`).

    Raises:
        Exception: whatever cloudpickle raises for an object it cannot pickle.
    """
    import cloudpickle

    return PolicyBlob(key, cloudpickle.dumps(policy, _PROTO), repr(policy), policy_sources(policy))


def _importable(top: str) -> bool:
    """Whether a new process can import the top-level module ``top`` (its finders find it; the
    modules of this process, ``sys.modules``, are not consulted)."""
    import sys

    if top in sys.builtin_module_names:
        return True
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            if find is not None and find(top, None) is not None:
                return True
        except Exception:  # noqa: BLE001 - a finder that cannot answer for this name
            continue
    return False


def shipping_problem(policy) -> str | None:
    """Why ``policy`` cannot travel to sub-server processes, or None when it can: cloudpickle
    cannot pickle it (a lock, an open file, a thread in its attributes), or one of its classes
    (its own and its attributes') lives in a module pickled by reference that a new process
    cannot import (a module imported from a path only this process has). Modules registered
    with ``cloudpickle.register_pickle_by_value`` and ``__main__`` (a notebook) travel by value."""
    import cloudpickle

    try:
        cloudpickle.dumps(policy, _PROTO)
    except Exception as e:  # noqa: BLE001 - whatever cloudpickle raises, reported with the fix
        return f"it cannot be pickled ({type(e).__name__}: {e})"
    by_value = cloudpickle.list_registry_pickle_by_value()
    classes = list(type(policy).__mro__) + [type(v) for v in getattr(policy, "__dict__", {}).values()]
    for cls in classes:
        mod = getattr(cls, "__module__", None) or "builtins"
        parts = mod.split(".")
        if mod == "__main__" or any(".".join(parts[:k]) in by_value for k in range(1, len(parts) + 1)):
            continue
        if not _importable(parts[0]):
            return (
                f"its class {cls.__qualname__} is defined in module {mod!r}, which a new process cannot "
                f"import (install it, or call cloudpickle.register_pickle_by_value on the module)"
            )
    return None


def load_policy(blob: PolicyBlob, where: str) -> RegisterPolicy:
    """The `RegisterPolicy` of a received `PolicyBlob`; a policy that cannot be loaded here
    (process of model ``where``) becomes one whose every call raises the load error, so only
    the requests that use it fail."""
    try:
        policy = pickle.loads(blob.data)
    except Exception as e:  # noqa: BLE001
        hint = ""
        if isinstance(e, (ImportError, AttributeError)):
            hint = (
                "; its module cannot be imported there: install it, or call "
                "cloudpickle.register_pickle_by_value(module) before a Router first uses the policy"
            )
        return RegisterPolicy(
            blob.key,
            _UnloadablePolicy(
                blob.text,
                f"policy {blob.text} could not be loaded in the sub-server process of model "
                f"'{where}': {type(e).__name__}: {e}{hint}",
            ),
        )
    try:
        restore_sources(policy, blob.sources or {})
    except Exception:  # noqa: BLE001 - names in tracebacks only; the policy works without them
        pass
    return RegisterPolicy(blob.key, policy)


class _UnloadablePolicy(Policy):
    """Stands in for a policy the child could not unpickle: every call raises, so the requests
    that use it fail with the load error and the others go on."""

    def __init__(self, text: str, error: str):
        self.text, self.error = text, error

    def __repr__(self) -> str:
        return self.text

    def route(self, step):  # the default route_batch calls it: the error names route, the hook users write
        raise RuntimeError(self.error)

    def send(self, req, target):
        raise RuntimeError(self.error)

    def receive(self, handoff, req):
        raise RuntimeError(self.error)


class _LoadError:
    """Stands in for a spec the child could not unpickle; the child reports ``text``."""

    def __init__(self, text: str):
        self.text = text


SEGMENT_BYTES = 1 << 30  # bytes of one shared-memory segment of `pack_shared` (a larger storage gets its own)
_ALIGN = 64  # bytes: each storage starts at a multiple of this in its segment
_PACK_LOCK = threading.Lock()


class _TensorFinder:
    """A pickling pass that only collects the tensors an object holds (whatever `dump_spec` would
    pickle: module parameters and buffers, tensors in plain attributes) without copying them."""

    def __init__(self):
        import cloudpickle
        import torch

        found: list = []

        class Finder(cloudpickle.CloudPickler):
            def reducer_override(self, obj):
                if isinstance(obj, torch.Tensor):
                    found.append(obj)
                    return int, ()
                return super().reducer_override(obj)

        self.pickler, self.found = Finder, found

    def __call__(self, obj) -> list:
        class _Null(io.RawIOBase):
            def writable(self):
                return True

            def write(self, b):
                return len(b)

        self.pickler(_Null(), protocol=_PROTO).dump(obj)
        return self.found


def pack_shared(obj, segment_bytes: int = SEGMENT_BYTES) -> dict:
    """Move the CPU tensors ``obj`` holds that are not in shared memory yet into a few shared-memory
    segments, storages side by side, and point each tensor at its place (``tensor.data =`` a view
    of its segment: parameters stay the same objects, models keep working, views keep sharing).
    Tensors sharing a storage (tied weights, views, the layers a truncated model shares with its
    source) keep sharing it. Each original storage is freed once nothing else refers to it, so the
    weights are not held twice (at most one segment more while packing).

    Args:
        obj: anything picklable, e.g. a dict of sub-server specs (runners with their models).
        segment_bytes: bytes per segment at most (a storage larger than this gets its own).

    Returns:
        ``{"segments": new segments, "storages": storages moved, "bytes": bytes moved}``.
    """
    with _PACK_LOCK:  # two Routers starting at once over the same models: one packs, the other sees it shared
        return _pack(obj, segment_bytes)


def _pack(obj, segment_bytes: int) -> dict:
    import torch

    groups: dict[int, tuple] = {}
    for t in _TensorFinder()(obj):
        if t.device.type != "cpu" or t.is_sparse or t.layout != torch.strided:
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.is_shared():
            continue
        key = st.data_ptr()
        if key not in groups:
            groups[key] = (st, [])
        if not any(x is t for x in groups[key][1]):
            groups[key][1].append(t)
    if not groups:
        return {"segments": 0, "storages": 0, "bytes": 0}
    plan, used = [], segment_bytes  # (segment index, offset, storage, tensors)
    sizes: list[int] = []
    for st, ts in groups.values():
        n = st.nbytes()
        if n > segment_bytes or used + n > segment_bytes or not sizes:
            sizes.append(0)
            used = 0
        plan.append((len(sizes) - 1, used, st, ts))
        used += -(-n // _ALIGN) * _ALIGN
        sizes[-1] = used
    segments = [torch.UntypedStorage._new_shared(n) for n in sizes]
    moved = 0
    with torch.no_grad():
        for k, off, st, ts in plan:
            seg, n = segments[k], st.nbytes()
            dst = torch.empty(0, dtype=torch.uint8).set_(seg, off, (n,), (1,))
            dst.copy_(torch.empty(0, dtype=torch.uint8).set_(st, 0, (n,), (1,)))
            for t in ts:
                size = t.element_size()
                t.data = torch.empty(0, dtype=t.dtype).set_(
                    seg, (off + t.storage_offset() * size) // size, t.size(), t.stride()
                )
            moved += n
    return {"segments": len(segments), "storages": len(plan), "bytes": moved}


class _FdCollector:
    """Takes the place of multiprocessing's spawning ``Popen`` while `dump_spec` pickles: torch's
    storage reduction hands it each shared-memory file descriptor through
    ``multiprocessing.reduction.DupFd`` (``DupFd(duplicate_for_child(fd))``), and the pickle
    holds an `_FdSlot` with the descriptor's position in ``fds`` (a descriptor met again, e.g. a
    segment of `pack_shared` holding many tensors, keeps its first position: it travels once).
    The descriptors stay owned by their storages (open while the spec is referenced)."""

    def __init__(self):
        self.fds: list[int] = []
        self._index: dict[int, int] = {}

    def duplicate_for_child(self, fd: int) -> int:
        if fd not in self._index:
            self._index[fd] = len(self.fds)
            self.fds.append(fd)
        return self._index[fd]

    @staticmethod
    def DupFd(index: int) -> "_FdSlot":  # noqa: N802 - the name multiprocessing.reduction calls
        return _FdSlot(index)


_received = threading.local()  # the descriptors `load_spec` is unpickling against, per thread


class _FdSlot:
    """A file descriptor in a pickled spec: its position among the descriptors sent with it.
    ``detach()`` (called by torch's ``rebuild_storage_fd``, which closes what it gets) hands over
    a duplicate of the received descriptor; `load_spec` closes the received ones."""

    def __init__(self, index: int):
        self.index = index

    def detach(self) -> int:
        return os.dup(_received.fds[self.index])


def _torch_cloudpickler():
    from multiprocessing.reduction import ForkingPickler

    import cloudpickle
    import torch.multiprocessing  # noqa: F401 - registers the tensor/storage reductions

    class TorchCloudPickler(cloudpickle.CloudPickler):
        dispatch_table = ChainMap(ForkingPickler._extra_reducers, cloudpickle.CloudPickler.dispatch_table)

    return TorchCloudPickler


def dump_spec(spec) -> tuple[bytes, list[int]]:
    """Pickle a sub-server spec for another process: cloudpickle (classes of ``__main__`` or a
    notebook cell by value) plus torch's reductions (CPU tensor storages moved to shared memory,
    each passed as a file descriptor; CUDA tensors as CUDA IPC handles).

    Returns:
        (the pickle's bytes, the file descriptors it refers to, in order). The descriptors belong
        to the tensors' storages: keep ``spec`` referenced until they are sent.

    Raises:
        whatever pickling raises (an object cloudpickle cannot pickle).
    """
    from multiprocessing import context

    collector = _FdCollector()
    before = context.get_spawning_popen()
    context.set_spawning_popen(collector)
    try:
        buf = io.BytesIO()
        _torch_cloudpickler()(buf, protocol=_PROTO).dump(spec)
    finally:
        context.set_spawning_popen(before)
    return buf.getvalue(), collector.fds


def load_spec(data: bytes, fds: list[int]):
    """Unpickle what `dump_spec` made, with the received descriptors ``fds`` (all are closed
    when this returns). Returns the spec, or a `_LoadError` saying why it could not be loaded
    (reported by the child through the hub)."""
    _received.fds = dict(enumerate(fds))
    try:
        return pickle.loads(data)
    except BaseException as e:  # noqa: BLE001 - reported by the child through the hub
        return _LoadError(
            f"could not load the sub-server spec in the child process: {type(e).__name__}: {e}\n"
            + traceback.format_exc()
        )
    finally:
        for fd in _received.fds.values():
            os.close(fd)
        _received.fds = None


_HEADER = struct.Struct("!QQ")  # number of descriptors, number of bytes
_FD_CHUNK = 200  # descriptors per message (Linux takes at most 253 in one SCM_RIGHTS message)


def send_spec(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send a pickled spec and its descriptors over a connected Unix stream socket.

    Raises:
        OSError: the peer is gone (e.g. BrokenPipeError) or the socket timed out.
    """
    sock.sendall(_HEADER.pack(len(fds), len(data)))
    for i in range(0, len(fds), _FD_CHUNK):
        socket.send_fds(sock, [b"f"], fds[i : i + _FD_CHUNK])
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError(f"the engine's process closed the spec channel after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_spec(sock: socket.socket) -> tuple[bytes, list[int]]:
    """Receive what `send_spec` sent: (the pickle's bytes, the descriptors, now owned here).

    Raises:
        EOFError: the sender closed the socket early.
        OSError: the descriptors were cut off (this process may open too few files: raise
            ``ulimit -n``).
    """
    n_fds, n_bytes = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    fds: list[int] = []
    try:
        while len(fds) < n_fds:
            msg, got, flags, _ = socket.recv_fds(sock, 1, min(_FD_CHUNK, n_fds - len(fds)))
            fds += got
            if not msg:
                raise EOFError(
                    f"the engine's process closed the spec channel after {len(fds)} of {n_fds} file descriptors"
                )
            if flags & socket.MSG_CTRUNC:
                raise OSError(
                    f"received {len(fds)} of {n_fds} file descriptors of the model's shared "
                    f"memory: the rest were cut off (too many open files? raise `ulimit -n`)"
                )
        return _recv_exact(sock, n_bytes), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class _FreshPool:
    """A `KVPool` of the same shape, allocated in the child: the KV cache is the sub-server's
    private memory, not shared with this process."""

    def __init__(self, pool):
        layers, slots, heads, dim = pool.k.shape
        self.args = (
            layers,
            heads,
            dim,
            pool.num_blocks,
            pool.block_size,
            pool.k.dtype,
            str(pool.k.device),
            getattr(pool, "scratch_blocks", 0),
        )

    def __reduce__(self):
        from ..core.kv_pool import KVPool

        return KVPool, self.args


def _child_spec(spec: dict) -> dict:
    """The spec as the child gets it: a runner object (model shared through shared memory) with
    a fresh KV pool of the same shape instead of this process's, and without this process's
    block allocator (the child's sub-server makes its own); a `RunnerSpec` as it is (it has no
    pool: the child builds the runner)."""
    import copy

    from ..core.kv_pool import KVPool

    spec = dict(spec)
    runner = spec.get("runner")
    fresh_pool = isinstance(getattr(runner, "pool", None), KVPool) and runner.pool.k is not None
    if fresh_pool or "kv_blocks" in getattr(runner, "__dict__", {}):
        runner = copy.copy(runner)
        runner.__dict__.pop("kv_blocks", None)
        if fresh_pool:
            runner.pool = _FreshPool(runner.pool)
        spec["runner"] = runner
    return spec
