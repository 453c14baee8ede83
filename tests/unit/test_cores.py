"""Core lending (`tokenrouter_sdk.engine.transports.cores`): a model alone at work takes every core, busy
models split them (the remainder to the first by index), a model that just went idle still
counts as busy for ``settle_s``, a model that wants cores a peer holds waits for the peer's next
step (at most ``wait_s``), and the sub-server processes of a Router mark themselves busy and
idle in the shared flags. One CPU model runs in a process by default (its forward then runs in
the process's main thread)."""

import threading
import time

import pytest

from tokenrouter_sdk.engine.transports.cores import CoreShare, create_flags


def _shares(tmp_path, models, cores, **kw):
    path = str(tmp_path / "busy")
    create_flags(path, models)
    got = [[] for _ in range(models)]
    return [CoreShare(path, i, models, cores, set_threads=got[i].append, **kw) for i in range(models)], got


def test_alone_takes_every_core_and_busy_models_split_them(tmp_path):
    (a, b), got = _shares(tmp_path, 2, 2, settle_s=0.0)
    a.busy()
    assert a.threads == 2 and got[0] == [2]
    b.busy()  # a holds 2: b waits for a's next step, then both compute on one core
    assert b.threads == 1
    a.busy()
    assert a.threads == 1 and got[0] == [2, 1]
    b.idle()
    a.busy()
    assert a.threads == 2 and got[0] == [2, 1, 2]


def test_the_remainder_goes_to_the_first_busy_models(tmp_path):
    shares, _ = _shares(tmp_path, 3, 5, settle_s=0.0, wait_s=0.0)
    for s in shares:
        s.busy()
    for s in shares:
        s.busy()
    assert [s.threads for s in shares] == [2, 2, 1]
    shares[0].idle()
    for s in shares[1:]:
        s.busy()
    assert [s.threads for s in shares[1:]] == [3, 2]


def test_a_peer_just_idle_with_requests_still_counts_as_busy(tmp_path):
    """A peer idle for less than settle_s that holds several requests may be back at once: it
    still counts. One holding a single request handed it over (one request in flight: the
    models take turns): this model takes every core at once."""
    (a, b), _ = _shares(tmp_path, 2, 2, settle_s=0.05, wait_s=0.0)
    b.busy()
    a.busy()
    b.idle(held=5)
    a.busy()
    assert a.threads == 1
    time.sleep(0.06)
    a.busy()
    assert a.threads == 2
    b.busy()
    a.busy()
    assert a.threads == 1
    b.idle(held=1)
    a.busy()
    assert a.threads == 2


def test_a_waiting_peer_gets_cores_between_two_layers(tmp_path):
    """give_back (called between layers of a step) hands the cores over at once: the waiting
    peer does not wait for the end of the step."""
    (a, b), got = _shares(tmp_path, 2, 2, settle_s=0.0, wait_s=2.0)
    a.busy()
    a.give_back()
    assert a.threads == 2  # nobody waits: nothing to give
    threading.Timer(0.03, a.give_back).start()
    t0 = time.monotonic()
    b.busy()
    assert time.monotonic() - t0 < 1.0 and a.threads == b.threads == 1 and got[0] == [2, 1]


def test_waiting_for_cores_ends_when_the_peer_gives_them_back_or_at_wait_s(tmp_path):
    (a, b), _ = _shares(tmp_path, 2, 2, settle_s=0.0, wait_s=0.5)
    a.busy()
    assert a.threads == 2
    threading.Timer(0.05, a.busy).start()  # a's next step: it sees b waiting and drops to one core
    t0 = time.monotonic()
    b.busy()
    waited = time.monotonic() - t0
    assert 0.03 <= waited < 0.4 and a.threads == b.threads == 1
    (tmp_path / "second").mkdir()
    (c, d), _ = _shares(tmp_path / "second", 2, 2, settle_s=0.0, wait_s=0.05)
    c.busy()  # c never steps again (as if it died holding both cores)
    t0 = time.monotonic()
    d.busy()
    assert 0.05 <= time.monotonic() - t0 < 0.3 and d.threads == 1


def test_sub_server_processes_mark_busy_and_idle():
    """Through a Router over two models in processes (the default without ``threads``): each
    child marks itself busy for its steps and idle once it waits, in the flags file."""
    import os

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate
    from tokenrouter_sdk.policies import RandomRouting

    large = tiny_model(num_layers=2, seed=3)
    models = {"small": truncate(large, 1), "large": large}
    with Router(
        models, RandomRouting(p=0.3, seed=1), tokenizer=tiny_tokenizer(), processes=True, max_kv_tokens=512
    ) as r:
        r.generate([[5, 6, 7], [8, 9]], max_new_tokens=12, ignore_eos=True)
        tr = r.engine.transport
        path = os.path.join(tr.launcher.cores_dir, "busy")
        probe = CoreShare(path, 0, 2, 2)
        probe._map()
        deadline = time.monotonic() + 5
        while any(probe._mm[:2]) and time.monotonic() < deadline:  # the children go idle after their last step
            time.sleep(0.01)
        assert list(probe._mm[:2]) == [0, 0]
        assert all(probe._since[i] > 0 for i in range(2))  # each went idle after being busy
        probe.close()
    assert not os.path.exists(path)


def test_one_cpu_model_runs_in_a_process_by_default(monkeypatch):
    from tokenrouter_sdk import Router
    from tokenrouter_sdk.engine.transports.process_transport import ProcessTransport
    from tokenrouter_sdk.models import tiny_model, tiny_tokenizer
    from tokenrouter_sdk.policies import LargeOnly

    monkeypatch.delenv("TOKENROUTER_PROCESSES", raising=False)
    with Router(
        {"large": tiny_model(num_layers=1, seed=4)}, LargeOnly(), tokenizer=tiny_tokenizer(), max_kv_tokens=256
    ) as r:
        assert isinstance(r.engine.transport, ProcessTransport)
        assert r.engine.transport.launcher.cores_dir is None  # one model: nothing to lend
        assert len(r.generate([[5, 6, 7]], max_new_tokens=4, ignore_eos=True)[0].token_ids) == 4
    monkeypatch.setenv("TOKENROUTER_PROCESSES", "0")
    with Router(
        {"large": tiny_model(num_layers=1, seed=4)}, LargeOnly(), tokenizer=tiny_tokenizer(), max_kv_tokens=256
    ) as r:
        assert not isinstance(r.engine.transport, ProcessTransport)


@pytest.mark.parametrize("models, cores, lends", [(1, 2, False), (2, 1, False), (2, 2, True), (3, 4, True)])
def test_only_a_share_that_can_lend_stops_a_step_between_layers(tmp_path, models, cores, lends):
    """A model alone (or on one core) has nothing to give back: its runner gets no call between
    layers, so a step can run its layers in one call; models that share cores get `give_back`."""
    from types import SimpleNamespace

    from tokenrouter_sdk.engine.transports.process_child import lend_between_layers

    shares, _ = _shares(tmp_path, models, cores)
    assert shares[0].lends is lends
    runner = SimpleNamespace(between_layers=None)
    lend_between_layers(runner, shares[0])
    assert runner.between_layers == (shares[0].give_back if lends else None)
    lend_between_layers(runner := SimpleNamespace(between_layers=None), None)
    assert runner.between_layers is None
