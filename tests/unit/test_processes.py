"""Sub-servers in their own processes (`ProcessTransport`): the same tokens as the naive
reference in async and gated (sync) modes, notebook-style policies shipped with cloudpickle,
two Routers side by side, a killed sub-server failing its requests, and no process left behind.

Starting sub-servers costs seconds the first time in an interpreter (the fork server imports
torch and transformers; see tests/unit/test_process_start.py for how processes start), so the
Routers are shared across tests where possible.
"""

import gc
import json
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tokenrouter_sdk import Handoff, Policy, Router, SamplingParams
from tokenrouter_sdk.engine.front.engine import EngineDeadError
from tokenrouter_sdk.engine.messages import Admitted, Committed, Finished
from tokenrouter_sdk.engine.transports.process_transport import ProcessTransport
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate

from ..helpers import DiscardTwoBack, mixed_prompts, run_script

N_NEW = 24
pytestmark = pytest.mark.timeout(180)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie still answers kill(0); it is gone once its parent reaped it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def routers(pair, tok):
    """An async and a sync Router over the float64 pair (async: the default transport choice for
    two torch models, processes over ipc://; sync: processes over tcp://), built at once so their
    four sub-server processes boot in parallel, alive side by side for the whole module. The last
    tests consume them."""
    saved = os.environ.pop("TOKENROUTER_PROCESSES", None)
    try:
        kws = {"async": {}, "sync": {"processes": {"address": "tcp"}}}

        def build(mode):
            return Router(pair, DiscardTwoBack(), tokenizer=tok, mode=mode, **kws[mode])

        with ThreadPoolExecutor(2) as ex:  # a Router returns once its processes run: build both at once
            rs = dict(zip(kws, ex.map(build, kws)))
    finally:
        if saved is not None:
            os.environ["TOKENROUTER_PROCESSES"] = saved
    yield rs
    for r in rs.values():
        r.close()


def _check(router, pair, policy, prompts, concurrency=8):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    outs = router.generate(prompts, sampling=params, policy=policy, concurrency=concurrency, timeout=120)
    for o in outs:
        assert o.finish_reason == "length", o.error
        ref = reference_generate(pair, o.prompt, policy, params, rid=o.rid)
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"]), f"rid {o.rid}"
        assert (o.hops, o.discarded) == (ref["hops"], ref["discarded"])
    assert sum(o.hops for o in outs) >= 4
    assert {m for o in outs for m in o.token_models} == {"small", "large"}
    return outs


def test_two_torch_models_default_to_processes(routers, pair, tok, monkeypatch):
    for r in routers.values():
        assert isinstance(r.engine.transport, ProcessTransport)
        assert r.engine.transport.wait_ready(0)  # Router() returned once every process had connected
    monkeypatch.setenv("TOKENROUTER_PROCESSES", "0")
    with Router(pair, tokenizer=tok) as r:  # the environment switch keeps tiny tests in threads
        assert not isinstance(r.engine.transport, ProcessTransport)
    with pytest.raises(ValueError, match="sim"):
        Router({"a": None, "b": None}, backend="sim", processes=True)


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("policy", [DiscardTwoBack(), RandomRouting(p=0.3, seed=3)], ids=["discard", "random"])
def test_equivalence_through_processes(routers, pair, mode, policy):
    r = routers[mode]
    outs = _check(r, pair, policy, mixed_prompts(8, seed=len(mode)))
    # children stamp events with the same system-wide clock as the engine
    trace, now = list(r.trace), time.perf_counter()
    for o in outs:
        admit = next(ev.t for ev in trace if isinstance(ev, Admitted) and ev.rid == o.rid)
        commits = [ev.t for ev in trace if isinstance(ev, Committed) and ev.rid == o.rid]
        finish = next(ev.t for ev in trace if isinstance(ev, Finished) and ev.rid == o.rid)
        assert admit < commits[0] <= commits[-1] <= finish <= now


def _kv_settled(router, timeout=10.0):
    """KV stats once every sub-server holds no request (releases travel between processes)."""
    deadline = time.monotonic() + timeout
    while True:
        st = router.kv_stats()
        if all(s.owned == s.pending == 0 for s in st.values()) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_kv_stats_through_processes_show_every_block_returned(routers, pair):
    r = routers["async"]
    before = r.kv_stats()
    want = {m: z.tokens // 16 for m, z in r.kv_sizing.items()}  # the children's pools are the planned size
    assert set(before) == {"small", "large"} and all(
        s.num_blocks == want[m] and s.block_size == 16 for m, s in before.items()
    )
    _check(r, pair, RandomRouting(p=0.3, seed=5), mixed_prompts(8, seed=11))
    after = _kv_settled(r)
    for name, s in after.items():
        assert (s.model, s.owned, s.pending) == (name, 0, 0)
        assert s.free_blocks == s.num_blocks, f"{name}: {s.num_blocks - s.free_blocks} KV blocks leaked"


def test_policy_defined_in_a_function_body(routers, pair):
    """A class that only exists in this function's frame reaches the sub-server processes
    (cloudpickle, by value) and runs there, not here."""
    here, every = os.getpid(), 3

    class LocalKeep(Policy):
        checking = True

        def route(self, step):
            if self.checking and os.getpid() == here:
                raise RuntimeError("route ran in the engine's process")
            step.state["n"] = step.state.get("n", 0) + 1
            return step.state["n"] % every == 0

        def send(self, req, target):
            return Handoff(keep_sampled=True)

    pol = LocalKeep()
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    outs = routers["async"].generate(mixed_prompts(8, seed=4), sampling=params, policy=pol, timeout=120)
    pol.checking = False  # the reference runs here
    for o in outs:
        assert o.finish_reason == "length", o.error
        assert o.token_ids == reference_generate(pair, o.prompt, pol, params, rid=o.rid)["token_ids"]
    assert sum(o.hops for o in outs) >= 8


def test_policy_the_children_cannot_load_fails_only_its_requests(routers, tmp_path, monkeypatch):
    (tmp_path / "parent_only_policy.py").write_text(
        "from tokenrouter_sdk import Policy\n\nclass ParentOnly(Policy):\n    def route(self, step):\n"
        "        return step.model\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # importable here, not in the running children
    from parent_only_policy import ParentOnly

    r = routers["async"]
    bad = r.submit(mixed_prompts(2), policy=ParentOnly(), max_new_tokens=4)
    good = r.generate(mixed_prompts(3), max_new_tokens=4, ignore_eos=True, timeout=60)
    bad.wait(timeout=60)
    assert all(o.finish_reason == "length" for o in good)
    for h in bad:
        assert h.output.finish_reason == "failed"
        assert "could not be loaded in the sub-server process" in h.output.error
        assert "register_pickle_by_value" in h.output.error


def test_two_routers_side_by_side(routers, pair):
    ra, rs = routers["async"], routers["sync"]
    ta, ts = ra.engine.transport, rs.engine.transport
    assert ta.address.startswith("ipc://") and ts.address.startswith("tcp://127.0.0.1:")
    assert not set(ta.pids().values()) & set(ts.pids().values())
    results, errors = {}, []

    def run(mode):
        try:
            results[mode] = _check(routers[mode], pair, RandomRouting(p=0.5, seed=7), mixed_prompts(6, seed=8))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,)) for m in ("async", "sync")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not errors, errors
    assert set(results) == {"async", "sync"}


def _explode_in_a_child(parent_pid):
    if os.getpid() != parent_pid:
        raise RuntimeError("this spec cannot be loaded here")


class _Unloadable:
    def __reduce__(self):
        return _explode_in_a_child, (os.getpid(),)


def test_a_process_that_cannot_start_fails_start_with_its_error():
    tr = ProcessTransport(start_timeout=120)
    with pytest.raises(RuntimeError, match=r"'bad': died \(exit code 1\).*cannot be loaded here"):
        tr.start({"bad": {"x": _Unloadable()}}, lambda ev: None)
    assert all(p.name != "tokenrouter-bad" for p in multiprocessing.active_children())
    assert tr._ipc_dir is None and not tr.alive("bad")


class Slow(Policy):
    """Stays on its model, slowly (so requests are still in flight when the process is killed)."""

    def route(self, step):
        time.sleep(0.01)
        return step.model


def test_a_killed_sub_server_is_restarted_and_serves_the_reference(pair, tok):
    """SIGKILL the large sub-server process mid-run (as the kernel's OOM killer does): its
    requests fail naming it, `Router.restart` starts a new process from the same spec, and the
    Router serves the reference's tokens again with every pool whole."""
    policy = RandomRouting(p=0.5, seed=3)
    with Router(pair, policy, tokenizer=tok, processes=True) as r:
        tr = r.engine.transport
        old = tr.pids()["large"]
        handles = r.submit(mixed_prompts(2, seed=2), policy=Slow(), max_new_tokens=200, ignore_eos=True)
        handles2 = r.submit(mixed_prompts(2, seed=5), max_new_tokens=400, ignore_eos=True)  # routed there too
        deadline = time.monotonic() + 60
        while not handles2[0].output.hops:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(old, signal.SIGKILL)
        handles2.wait(timeout=30)
        for h in handles2:
            # failed where it stood: on large when it died, or routed there after the death was seen
            assert h.output.finish_reason == "failed" and (
                "sub-server process 'large' died" in h.output.error or "model 'large' is dead" in h.output.error
            ), h.output.error
        deadline = time.monotonic() + 30  # a request can fail by a dead letter before the death is reported
        while "large" not in r.dead:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(EngineDeadError, match=r"router.restart\('large'\)"):
            r.generate(mixed_prompts(1), max_new_tokens=4, timeout=30)
        assert r.restart("large", timeout=60) == ["large"]
        assert tr.pids()["large"] != old and tr.alive("large") and _gone(old)
        handles.wait(timeout=60)  # never routed to large: served through the death and the restart
        assert all(h.output.finish_reason == "length" for h in handles)
        _check(r, pair, policy, mixed_prompts(3, seed=4))
        stats = _kv_settled(r, timeout=30)  # the last releases travel between the processes
        assert all(s.alive and s.free_blocks == s.num_blocks for s in stats.values()), {
            m: dict(alive=s.alive, free=s.free_blocks, blocks=s.num_blocks, owned=s.owned, pending=s.pending)
            for m, s in stats.items()
        }


def test_killed_subserver_fails_its_requests_and_close_ends_the_rest(routers):
    r = routers.pop("async")
    tr = r.engine.transport
    pids, addr = tr.pids(), tr.address
    try:
        handles = r.submit(mixed_prompts(6, seed=1), policy=Slow(), max_new_tokens=400, ignore_eos=True)
        deadline = time.monotonic() + 60
        while not handles[0].output.token_ids:  # in flight: the child is serving
            assert time.monotonic() < deadline and not handles[0].done.is_set()
            time.sleep(0.02)
        os.kill(pids["small"], signal.SIGKILL)
        t0 = time.monotonic()
        handles.wait(timeout=30)
        assert time.monotonic() - t0 < 10
        for h in handles:
            assert h.output.finish_reason == "failed"
            assert "sub-server process 'small' died" in h.output.error and "SIGKILL" in h.output.error
        assert not tr.alive("small") and tr.alive("large")
        with pytest.raises(EngineDeadError, match="model 'small'.*died"):  # a later call: a clear error at once
            r.generate(mixed_prompts(2), max_new_tokens=4, timeout=30)
        assert r.kv_stats(timeout=30)["small"].alive is False
    finally:
        r.close()
    r.close()  # idempotent
    assert all(_gone(p) for p in pids.values())
    assert not set(pids.values()) & {p.pid for p in multiprocessing.active_children()}
    assert addr.startswith("ipc://") and not os.path.exists(os.path.dirname(addr[len("ipc://") :]))


def test_garbage_collected_router_ends_its_processes(routers):
    r = routers.pop("sync")
    pids = list(r.engine.transport.pids().values())
    del r
    gc.collect()
    deadline = time.monotonic() + 15
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids)
    assert not multiprocessing.active_children()


SCRIPT = """
import gc, json, multiprocessing, os
from tokenrouter_sdk import Policy, Router, SamplingParams
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer
from tokenrouter_sdk.reference import reference_generate

HERE = os.getpid()


def helper(step):  # a __main__ function the policy calls
    return step.model


class MainPolicy(Policy):  # lives in __main__ only: no guard, no importable module
    checking = True

    def route(self, step):
        if self.checking and os.getpid() == HERE:
            raise RuntimeError("route ran in the engine's process")
        step.state["calls"] = step.state.get("calls", 0) + 1
        return helper(step)


models = {"large": tiny_model(num_layers=2, seed=3)}
pol = MainPolicy()
r = Router(models, pol, tokenizer=tiny_tokenizer(), processes=True)
kind = type(r.engine.transport).__name__
params = SamplingParams(max_new_tokens=10, ignore_eos=True)
outs = r.generate([[5, 6, 7], [40, 41], [9]], sampling=params, timeout=120)
pids = list(r.engine.transport.pids().values())
del r
gc.collect()
pol.checking = False
same = all(o.token_ids == reference_generate(models, o.prompt, pol, params, rid=o.rid)["token_ids"] for o in outs)
print(json.dumps({"kind": kind, "errors": [o.error for o in outs],
                  "same": same, "children": len(multiprocessing.active_children()), "pids": pids}))
"""


def test_policy_defined_in_main_of_a_script(tmp_path):
    res = run_script(tmp_path, SCRIPT, "notebook_like.py", timeout=170)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["kind"] == "ProcessTransport"
    assert out["errors"] == [None, None, None] and out["same"], out
    assert out["children"] == 0 and all(_gone(p) for p in out["pids"])
