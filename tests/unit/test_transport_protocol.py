"""The `Transport` protocol declares every method the engine calls, and every transport has them."""

import inspect

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk import router as router_module
from tokenrouter_sdk.backends.sim_runner import LatencyModel
from tokenrouter_sdk.engine.front import engine as engine_module
from tokenrouter_sdk.engine.runner import Transport
from tokenrouter_sdk.engine.transports.hub import HubTransport
from tokenrouter_sdk.engine.transports.process_transport import ProcessTransport
from tokenrouter_sdk.engine.transports.ray_transport import RayTransport
from tokenrouter_sdk.engine.transports.sim_transport import SimTransport
from tokenrouter_sdk.engine.transports.transport import ThreadTransport
from tokenrouter_sdk.policies import LargeOnly

ENGINE_CALLS = {"start", "send", "hold", "clock", "alive", "close", "restart", "reported", "local_runner", "pending"}
ROUTER_CALLS = {"pids"}
TRANSPORTS = (ThreadTransport, SimTransport, HubTransport, ProcessTransport, RayTransport)


def declared(proto) -> set[str]:
    return {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}


def test_the_protocol_declares_what_the_engine_calls():
    assert declared(Transport) == ENGINE_CALLS | ROUTER_CALLS
    called = set()
    src = inspect.getsource(engine_module)
    for n in ENGINE_CALLS | {"subservers", "child_threads", "pids"}:
        if f"self.transport.{n}" in src:
            called.add(n)
    assert called <= ENGINE_CALLS, called - ENGINE_CALLS
    assert "getattr(self.transport" not in src and "hasattr(self.transport" not in src


@pytest.mark.parametrize("cls", TRANSPORTS, ids=lambda c: c.__name__)
def test_every_transport_implements_the_protocol(cls):
    missing = [n for n in sorted(ENGINE_CALLS | ROUTER_CALLS) if not callable(getattr(cls, n, None))]
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert isinstance(vars(Transport)["child_threads"], property) and hasattr(cls, "child_threads")


def test_the_router_reads_the_transport_without_probing(pair, tok):
    src = inspect.getsource(router_module)
    assert "getattr(self.engine.transport" not in src and "hasattr(self.engine.transport" not in src
    with Router(pair, LargeOnly(), tokenizer=tok, processes=False) as r:
        assert r.pids() is None and r.child_threads is None


def test_sim_transport_answers_each_call():
    lat = {"small": LatencyModel({1: 0.01}), "large": LatencyModel({1: 0.02})}
    with Router(lat, LargeOnly(), backend="sim") as r:
        t = r.engine.transport
        assert isinstance(t, SimTransport)
        assert set(t.reported()) == {"small", "large"}
        assert t.reported()["large"] == r.engine.info["large"].geometry()
        runner = t.local_runner("large")
        assert runner is not None and runner is t.subservers["large"].runner.wrapped
        assert r.engine.runners["large"] is runner
        assert t.local_runner("huge") is None
        assert t.pending("large") is False
        with pytest.raises(
            RuntimeError,
            match=r"restart\('large'\): SimTransport cannot restart a sub-server; "
            r"close this Router and build a new one",
        ):
            t.restart("large")
