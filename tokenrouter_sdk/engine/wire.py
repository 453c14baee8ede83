"""What travels between the engine and sub-server processes (`ProcessTransport`).

Per-step messages and events are small dataclasses sent with plain pickle; `RegisterPolicy`
(and anything plain pickle refuses) goes with cloudpickle, so a `Policy` class defined in a
notebook cell reaches the sub-server processes. The start-up spec (runner with its model) is
pickled with cloudpickle plus torch's multiprocessing reductions, so model weights travel as
shared memory, not copies; the KV pool is re-allocated in the child (`_FreshPool`).
"""

from __future__ import annotations

import io
import pickle
import traceback
from collections import ChainMap

from ..policy import Policy
from .messages import RegisterPolicy

_PROTO = pickle.HIGHEST_PROTOCOL

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
        self.args = (layers, heads, dim, pool.num_blocks, pool.block_size, pool.k.dtype, str(pool.k.device),
                     getattr(pool, "scratch_blocks", 0))

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
