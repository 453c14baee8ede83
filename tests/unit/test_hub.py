"""The hub is one data path under any launcher (`tokenrouter_sdk.engine.transports.hub`): a launcher
written against the `Launcher` protocol alone, whose sub-servers run in threads of this process
and connect to the hub's socket, serves a routed run equal to the reference; the hub keeps what
the launcher says of each start-up, shows the engine events as the launcher adjusts them, and
reports a sub-server that ends with the requests it held failed."""

import dataclasses
import os
import pickle
import threading
import time

import cloudpickle
import pytest

from tokenrouter_sdk import SamplingParams
from tokenrouter_sdk.backends.torch_runner import TorchRunnerSpec
from tokenrouter_sdk.engine import messages
from tokenrouter_sdk.engine.front.engine import Engine
from tokenrouter_sdk.engine.transports.hub import HubTransport
from tokenrouter_sdk.engine.transports.process_child import run_subserver
from tokenrouter_sdk.engine.transports.process_transport import ProcessTransport
from tokenrouter_sdk.engine.transports.ray_transport import RayLauncher
from tokenrouter_sdk.engine.transports.wire import _child_spec
from tokenrouter_sdk.models import tiny_model, truncate
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate
from tokenrouter_sdk.request import RequestInput

from ..helpers import mixed_prompts


class ThreadStarted:
    """A sub-server thread as the hub watches it: a pipe closes when the thread ends (``lag``
    seconds before `ended` says so, as a process's pipes close before its exit status is there)."""

    def __init__(self, name: str, target, lag: float = 0.0):
        self.pid, self.exitcode = os.getpid(), None
        self._r, self._w = os.pipe()

        def run():
            try:
                self.exitcode = target()
            finally:
                os.close(self._w)
                time.sleep(lag)

        self.thread = threading.Thread(target=run, name=f"test-subserver-{name}", daemon=True)
        self.thread.start()

    def sentinels(self) -> list:
        return [self._r]

    def ended(self) -> bool:
        return not self.thread.is_alive()

    def signal(self, sig: int) -> None:
        pass  # a thread ends on the Shutdown the hub sends

    def join(self, timeout=None) -> None:
        self.thread.join(timeout)

    def close(self) -> None:
        os.close(self._r)


class ThreadLauncher:
    kind, what, threads = "test-threads", "the test's sub-server threads", 1

    def __init__(self, shift: float = 0.0, crash: str | None = None, lag: float = 0.0, times: int = 1 << 30):
        self.shift, self.crash, self.lag, self.times = shift, crash, lag, times
        self.crashes: dict[str, int] = {}  # model -> starts that crashed
        self.relaunch_s = 0.0  # a restart's launch returns this late (its sub-server may say hi first)
        self.calls: list[str] = []

    def prepare(self, specs):
        self.calls.append("prepare")
        return None

    def launch(self, specs, address, report, started):
        self.calls.append("launch")
        for name, spec in specs.items():
            payload = cloudpickle.dumps(_child_spec(spec))

            def serve(name=name, payload=payload):
                if name == self.crash and self.crashes.get(name, 0) < self.times:
                    self.crashes[name] = self.crashes.get(name, 0) + 1
                    time.sleep(0.3)
                    report(name, "the test ended it")
                    return 7
                return run_subserver(
                    name, address, 1, lambda: (payload,), pickle.loads, t_main=time.perf_counter(), watch_parent=False
                )

            started[name] = ThreadStarted(name, serve, self.lag if name == self.crash else 0.0)
            if self.calls.count("launch") > 1:  # a restart: return late, as a Ray actor's start does
                time.sleep(self.relaunch_s)

    def deliver(self, specs):
        self.calls.append("deliver")

    def boot(self, model, hello, now):
        return {"by": "threads", "pid": hello["pid"]}

    def adjust(self, event):
        if self.shift and isinstance(event, messages.StepDone):
            event = dataclasses.replace(event, t_start=event.t_start + self.shift, t_end=event.t_end + self.shift)
        return event

    def kill_all(self, started):
        self.calls.append("kill_all")
        for p in started.values():
            p.join(10.0)

    def close(self):
        self.calls.append("close")

    def start_error(self, e):
        return e


@pytest.fixture(scope="module")
def models():
    large = tiny_model(num_layers=2, seed=41)
    return {"small": truncate(large, 1), "large": large}


def _run(engine, prompts, policy, params):
    call = engine.submit([RequestInput(p, params, prompt=p) for p in prompts], policy, concurrency=4)
    call.wait(120)
    return call.outputs


def test_a_launcher_of_its_own_serves_a_routed_run_equal_to_the_reference(models, tok):
    launcher = ThreadLauncher()
    transport = HubTransport(launcher, start_timeout=60)
    runners = {n: TorchRunnerSpec(m, max_kv_tokens=512) for n, m in models.items()}
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine = Engine(runners, tok, transport=transport)
    try:
        assert transport.start_method == "test-threads" and transport.child_threads == 1
        assert transport.boot == {n: {"by": "threads", "pid": os.getpid()} for n in models}
        outs = _run(engine, mixed_prompts(5, seed=6), RandomRouting(p=0.4, seed=3), params)
    finally:
        engine.close()
    assert launcher.calls == ["prepare", "launch", "deliver", "kill_all", "close"]
    for o in outs:
        assert o.finish_reason == "length", o.error
        ref = reference_generate(models, o.prompt, RandomRouting(p=0.4, seed=3), params, rid=o.rid)
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"]), o.rid
    assert {m for o in outs for m in o.token_models} == {"small", "large"}
    assert not [t for t in threading.enumerate() if t.name.startswith("test-subserver")]


def test_the_engine_sees_events_as_the_launcher_adjusts_them(models, tok):
    seen = []
    launcher = ThreadLauncher(shift=1000.0)
    engine = Engine(
        {n: TorchRunnerSpec(m, max_kv_tokens=512) for n, m in models.items()},
        tok,
        transport=HubTransport(launcher, start_timeout=60),
    )
    engine.add_observer(seen.append)
    try:
        _run(engine, [[5, 6, 7]], RandomRouting(p=0.5, seed=1), SamplingParams(max_new_tokens=4, ignore_eos=True))
    finally:
        engine.close()
    steps = [ev for ev in seen if isinstance(ev, messages.StepDone)]
    assert steps and all(ev.t_start > time.perf_counter() + 900 for ev in steps)


def test_a_sub_server_that_ends_is_reported_with_what_it_held(models, tok):
    launcher = ThreadLauncher(crash="large")
    transport = HubTransport(launcher, start_timeout=None)
    engine = Engine({n: TorchRunnerSpec(m, max_kv_tokens=512) for n, m in models.items()}, tok, transport=transport)
    try:
        outs = _run(
            engine, [[5, 6, 7], [8, 9]], RandomRouting(p=0.9, seed=1), SamplingParams(max_new_tokens=6, ignore_eos=True)
        )
        assert engine.dead == {"large": "sub-server process 'large' died (exit code 7): the test ended it"}
    finally:
        engine.close()
    assert all(o.finish_reason == "failed" and "'large' died (exit code 7)" in o.error for o in outs)


def _crash_run(models, tok, lag: float = 0.0):
    """The crash-report run (the large sub-server ends while requests are routed to it); returns
    the outputs and the engine's dead models, within 30 s (a lost death notice times out)."""
    engine = Engine(
        {n: TorchRunnerSpec(m, max_kv_tokens=512) for n, m in models.items()},
        tok,
        transport=HubTransport(ThreadLauncher(crash="large", lag=lag), start_timeout=None),
    )
    try:
        call = engine.submit(
            [RequestInput(p, SamplingParams(max_new_tokens=6, ignore_eos=True), prompt=p) for p in ([5, 6, 7], [8, 9])],
            RandomRouting(p=0.9, seed=1),
            concurrency=4,
        )
        call.wait(30)
        return call.outputs, engine.dead
    finally:
        engine.close()


def test_an_end_seen_before_it_is_reported_is_not_lost(models, tok):
    """The sub-server's pipe closes 0.5 s before `ended` says so (as a process's pipes close
    before its exit status is there): the hub asks again until it has ended, and reports it."""
    outs, dead = _crash_run(models, tok, lag=0.5)
    assert dead == {"large": "sub-server process 'large' died (exit code 7): the test ended it"}
    assert all(o.finish_reason == "failed" and "'large' died (exit code 7)" in o.error for o in outs)


def test_the_crash_report_survives_a_cpu_hog(models, tok):
    """Twenty crash-report runs while busy loops hold every core: no death notice is lost."""
    import subprocess
    import sys

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        for i in range(20):
            outs, dead = _crash_run(models, tok)
            assert set(dead) == {"large"}, i
            assert all(o.finish_reason == "failed" and "'large' died (exit code 7)" in o.error for o in outs), i
    finally:
        for h in hogs:
            h.kill()
            h.wait()


@pytest.mark.parametrize("relaunch_s", [0.0, 1.0])
def test_a_sub_server_that_ended_is_restarted_by_the_launcher_and_serves(models, tok, relaunch_s):
    """The hub restarts a dead sub-server with its launcher (one more `launch` of that model),
    watches the new one, sends it the policies first, and the engine serves the reference again;
    also when the new sub-server says hi before its launch returned."""
    launcher = ThreadLauncher(crash="large", times=1)
    launcher.relaunch_s = relaunch_s
    engine = Engine(
        {n: TorchRunnerSpec(m, max_kv_tokens=512) for n, m in models.items()},
        tok,
        transport=HubTransport(launcher, start_timeout=None),
    )
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    try:
        outs = _run(engine, [[5, 6, 7], [8, 9]], RandomRouting(p=0.9, seed=1), params)
        assert all(o.finish_reason == "failed" for o in outs) and set(engine.dead) == {"large"}
        engine.restart("large", timeout=60)
        assert not engine.dead and launcher.calls == ["prepare", "launch", "deliver", "launch", "deliver"]
        outs = _run(engine, mixed_prompts(4, seed=8), RandomRouting(p=0.4, seed=3), params)
    finally:
        engine.close()
    for o in outs:
        assert o.finish_reason == "length", o.error
        ref = reference_generate(models, o.prompt, RandomRouting(p=0.4, seed=3), params, rid=o.rid)
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"]), o.rid
    assert {m for o in outs for m in o.token_models} == {"small", "large"}


def test_process_and_ray_transports_only_pass_their_launcher_in():
    """Both are a `HubTransport` with a launcher: neither overrides the hub's methods."""
    from tokenrouter_sdk.engine.transports.ray_transport import RayTransport

    for cls in (ProcessTransport, RayTransport):
        own = {k for k, v in vars(cls).items() if callable(v) or isinstance(v, property)}
        assert own <= {"__init__", "nodes", "actors", "placement_group"}, (cls, own)
    assert ProcessTransport(start_method="spawn").start_method == "spawn"
    assert RayLauncher.kind == "ray"
