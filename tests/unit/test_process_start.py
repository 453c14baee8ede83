"""How sub-server processes start (`tokenrouter_sdk.engine.transports.process_start`, `wire.send_spec`):
forked from a fork server that imported torch and transformers once, a fresh process per Router
(nothing of an earlier Router's sub-server survives), weights mapped from shared memory (not
copied), more storages than multiprocessing passes descriptors for, a killed fork server
replaced, ``start_method="spawn"`` still available, and every process gone when the parent
dies.

Speed is measured by ``evals/throughput/router_start_time.py``, not here.
"""

import json
import os
import signal
import sys
import threading
import time

import pytest

from tokenrouter_sdk import Policy, Router, SamplingParams
from tokenrouter_sdk.engine.transports.process_transport import ProcessTransport
from tokenrouter_sdk.models import tiny_model, truncate
from tokenrouter_sdk.reference import reference_generate

from ..helpers import mixed_prompts, run_script

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server and /proc are Linux's"),
]

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie still answers kill(0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pids, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _same_as_reference(router, models, policy, n=4, seed=0):
    outs = router.generate(mixed_prompts(n, seed=seed), sampling=PARAMS, policy=policy, timeout=120)
    for o in outs:
        assert o.finish_reason == "length", o.error
        assert o.token_ids == reference_generate(models, o.prompt, policy, PARAMS, rid=o.rid)["token_ids"]
    return outs


class MarkProcess(Policy):
    """In a sub-server process (not in ``here``, where the reference runs), leaves a mark in
    the process's state (a module attribute) on every step."""

    def __init__(self, here: int):
        self.here = here

    def route(self, step):
        if os.getpid() != self.here:
            import tokenrouter_sdk

            tokenrouter_sdk._left_by_an_earlier_router = os.getpid()
        return step.model


class FailIfMarked(MarkProcess):
    """In a sub-server process, fails its requests if the process carries a mark."""

    def route(self, step):
        import tokenrouter_sdk

        mark = getattr(tokenrouter_sdk, "_left_by_an_earlier_router", None)
        if os.getpid() != self.here and mark is not None:
            raise RuntimeError(f"this process carries the state of process {mark}")
        return step.model


def test_routers_fork_fresh_processes_from_one_preloaded_server(pair, tok):
    """Every sub-server is forked from the fork server with the sub-server code (torch,
    transformers) already imported; a second Router gets new processes from the same server,
    without the first one's state."""
    here = os.getpid()
    with Router(pair, tokenizer=tok, processes=True) as r1:
        tr1 = r1.engine.transport
        _same_as_reference(r1, pair, MarkProcess(here))
        pids1 = tr1.pids()
        server = {_ppid(p) for p in pids1.values()}
        assert {m: b["preloaded"] for m, b in tr1.boot.items()} == {"small": True, "large": True}
        assert {m: b["pid"] for m, b in tr1.boot.items()} == pids1
    assert _wait_gone(pids1.values())
    with Router(pair, tokenizer=tok, processes=True) as r2:
        tr2 = r2.engine.transport
        _same_as_reference(r2, pair, FailIfMarked(here), seed=1)
        pids2 = tr2.pids()
        assert all(b["preloaded"] for b in tr2.boot.values())
        assert {_ppid(p) for p in pids2.values()} == server and server != {os.getpid()}
        assert not set(pids2.values()) & set(pids1.values())
        assert set(tr2.boot["large"]) >= {"start", "to_main", "pickle", "transfer", "unpickle", "build", "connect"}


def _shm_inode(pid: int, addr: int):
    """The inode of the shared-memory file mapped at ``addr`` in process ``pid``, or None."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return int(parts[4]) if len(parts) > 5 and parts[5].startswith("/dev/shm/") else None
    return None


def _shm_inodes(pid: int) -> set[int]:
    with open(f"/proc/{pid}/maps") as f:
        return {int(p[4]) for p in (line.split() for line in f) if len(p) > 5 and p[5].startswith("/dev/shm/")}


def test_weights_are_shared_memory_and_more_storages_than_a_launch_passes(tok):
    """A 40-layer model has 364 parameter storages, more than multiprocessing hands a new
    process (256 descriptors): they go over the spec channel in chunks. Every weight of the
    parent is a shared-memory mapping that each sub-server maps too (the same files: shared,
    not copied)."""
    large = tiny_model(num_layers=40, hidden_size=32, num_heads=2, num_kv_heads=1, seed=5)
    models = {"small": truncate(large, 20), "large": large}
    params = list(large.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) > 256
    with Router(models, tokenizer=tok, processes=True) as r:
        _same_as_reference(r, models, Policy(), n=2)
        for name, pid in r.engine.transport.pids().items():
            parent = {_shm_inode(os.getpid(), p.data_ptr()) for p in models[name].parameters()}
            assert None not in parent, "a weight of this process is not in shared memory"
            missing = parent - _shm_inodes(pid)
            assert not missing, f"sub-server '{name}' does not map {len(missing)} of the weight storages"


def test_killed_fork_server_is_replaced_and_running_routers_keep_serving(pair, tok):
    with Router(pair, tokenizer=tok, processes=True) as r1:
        tr1 = r1.engine.transport
        server = _ppid(tr1.pids()["large"])
        assert server != os.getpid()
        os.kill(server, signal.SIGKILL)
        assert _wait_gone([server])
        time.sleep(0.3)  # a death the hub would (wrongly) see arrives by now
        assert tr1.alive("small") and tr1.alive("large") and not r1.engine.dead
        _same_as_reference(r1, pair, Policy(), n=2)
        with Router(pair, tokenizer=tok, processes=True) as r2:  # a new fork server
            tr2 = r2.engine.transport
            new = {_ppid(p) for p in tr2.pids().values()}
            assert len(new) == 1 and new.isdisjoint({server, os.getpid()})
            assert all(b["preloaded"] for b in tr2.boot.values())
            _same_as_reference(r2, pair, Policy(), n=2, seed=3)
        pids1 = list(tr1.pids().values())
    assert _wait_gone(pids1)


def test_spawn_start_method(pair, tok):
    with Router(pair, tokenizer=tok, processes={"start_method": "spawn"}) as r:
        tr = r.engine.transport
        assert tr.start_method == "spawn"
        assert {m: b["preloaded"] for m, b in tr.boot.items()} == {"small": False, "large": False}
        assert {_ppid(p) for p in tr.pids().values()} == {os.getpid()}
        _same_as_reference(r, pair, Policy(), n=2)
        pids = list(tr.pids().values())
    assert _wait_gone(pids)
    with pytest.raises(ValueError, match="start_method must be one of"):
        ProcessTransport(start_method="fork")


SCRIPT = """
import json, os, signal, sys
from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate

large = tiny_model(num_layers=2, seed=3)
r = Router({"small": truncate(large, 1), "large": large}, tokenizer=tiny_tokenizer(), processes=True)
out = r.generate([[5, 6, 7]], max_new_tokens=4, ignore_eos=True, timeout=120)
pids = list(r.engine.transport.pids().values())
with open(f"/proc/{pids[0]}/stat") as f:
    server = int(f.read().rsplit(")", 1)[1].split()[1])
print(json.dumps({"pids": pids, "server": server, "me": os.getpid(), "error": out[0].error}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sub_servers_and_fork_server_end_with_a_killed_parent(tmp_path):
    res = run_script(tmp_path, SCRIPT, "killed_parent.py", timeout=200)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["error"] is None and out["server"] != out["me"] and len(out["pids"]) == 2
    assert _wait_gone([*out["pids"], out["server"]], timeout=20), "a process outlived its killed parent"


class ForkThenExit(Policy):
    """In a sub-server process: forks a child that sleeps (and so holds every descriptor of
    the sub-server, its spec channel included), writes its pid to ``pidfile`` and exits 3."""

    def __init__(self, here: int, pidfile: str):
        self.here, self.pidfile = here, pidfile

    def route(self, step):
        if os.getpid() != self.here:
            pid = os.fork()
            if pid == 0:
                time.sleep(120)
                os._exit(0)
            with open(self.pidfile, "w") as f:
                f.write(str(pid))
            os._exit(3)
        return step.model


def test_a_sub_server_that_leaves_a_child_behind_is_still_seen_to_end(pair, tok, tmp_path):
    pidfile = tmp_path / "grandchild"
    with Router(pair, tokenizer=tok, processes=True) as r:
        call = r.submit(mixed_prompts(2), policy=ForkThenExit(os.getpid(), str(pidfile)), max_new_tokens=4)
        try:
            call.wait(timeout=60)  # raises TimeoutError if the death went unseen
            for h in call:
                assert h.output.finish_reason == "failed"
                assert "sub-server process 'small' died (exit code 3)" in h.output.error
        finally:
            if pidfile.exists():
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
        assert not r.engine.transport.alive("small") and r.engine.transport.alive("large")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_cpu_kv_pool_takes_memory_only_when_used():
    """A sub-server allocates its KV pool when it starts (and the Router did too, before
    handing the runner over): zero pages the kernel fills on first touch, not a fill of the
    whole pool, so hundreds of MB cost neither time nor memory until blocks are written."""
    from tokenrouter_sdk.engine.core.kv_pool import KVPool

    before = _rss_bytes()
    pool = KVPool(num_layers=16, kv_heads=4, head_dim=64, num_blocks=512, block_size=16)  # 2 x 128 MiB
    grown = _rss_bytes() - before
    assert pool.k.shape == (16, 512 * 16, 4, 64) and grown < 32 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB"
    assert float(pool.k[3, 100:200].abs().sum()) == 0.0
    pool.k[3, 100] = 1.0
    assert float(pool.k.sum()) == 4 * 64 and float(pool.v.sum()) == 0.0


def test_pickling_error_names_the_model_and_leaves_nothing_behind(tok):
    """A spec this process cannot pickle fails `start` with the model's name; nothing is left
    running."""
    tr = ProcessTransport(start_timeout=60)
    with pytest.raises(TypeError, match="spec of model 'bad' cannot be sent"):
        tr.start({"bad": {"lock": threading.Lock()}}, lambda ev: None)
    assert _wait_gone(list(tr.pids().values()))
    assert tr._ipc_dir is None and not tr.alive("bad")


@pytest.mark.parametrize(
    "processes,env,started",
    [
        (None, None, True),
        (None, "0", False),
        (True, "0", True),
        (False, None, False),
        ({"address": "tcp"}, None, True),
        ({"start_method": "spawn"}, None, False),
        ({"start_method": "forkserver"}, None, True),
    ],
)
def test_router_default_starts_the_fork_server_early_only_for_processes(monkeypatch, processes, env, started):
    """`Router.default` starts the fork server before loading the pair (its imports overlap the
    load) when the Router will fork sub-servers from it, and not otherwise."""
    from tokenrouter_sdk.engine.transports import process_start

    calls = []
    monkeypatch.setattr(process_start, "prestart", lambda method=None, modules=(): calls.append((method, modules)))
    if env is None:
        monkeypatch.delenv("TOKENROUTER_PROCESSES", raising=False)
    else:
        monkeypatch.setenv("TOKENROUTER_PROCESSES", env)
    process_start.prestart_for(processes, ("some.module",))
    assert calls == ([("forkserver", ("some.module",))] if started else [])
