"""A client that goes away aborts its request wherever it is: before its first token, while it
runs, while it is pending on the other model (its KV kept there), and for a plain (not
streamed) request that times out. The request ends ``aborted``, nothing is committed to it
afterwards, every KV pool returns to its initial free blocks and the server holds nothing.

Timing is made deterministic with scripted runners (tests/helpers.py): each forward sleeps
``delay_s``, and the test waits for the stage it wants (read from the stream and `kv_stats`)
before it disconnects."""

import threading
import time

import httpx
import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_tokenizer
from tokenrouter_sdk.policies.registry import builtin_registry

from ..helpers import HandTo, ScriptedRunner, StayOn, pools_free
from .conftest import serving

TOKENS = list(range(65, 91))  # 'A'..'Z' on the byte tokenizer


class StayOnSmall(StayOn):
    def __init__(self):
        super().__init__("small")


class HandToLarge(HandTo):
    def __init__(self):
        super().__init__("large", after=2)


@pytest.fixture(scope="module")
def scripted():
    tok = tiny_tokenizer()
    pair = {"small": ScriptedRunner(lambda p: TOKENS[p % 26]), "large": ScriptedRunner(lambda p: TOKENS[(p + 3) % 26])}
    router = Router(pair, StayOnSmall(), tokenizer=tok)
    registry = builtin_registry()
    registry.add("stay_small", StayOnSmall)
    registry.add("hand_to_large", HandToLarge)
    initial = pools_free(router)
    events: list = []
    remove = router.engine.add_observer(events.append)
    with serving(router, registry=registry) as (url, app):
        yield router, url, app, pair, initial, events
    remove()
    router.close()


def _outcome(events, rid):
    fin = [e for e in events if type(e).__name__ == "Finished" and e.rid == rid]
    assert len(fin) == 1, fin
    later = [e for e in events if type(e).__name__ == "Committed" and e.rid == rid and e.t > fin[0].t]
    committed = sum(len(e.tokens) for e in events if type(e).__name__ == "Committed" and e.rid == rid)
    return fin[0], later, committed


def _new_rid(events, seen: set) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rids = [e.rid for e in list(events) if type(e).__name__ == "Admitted" and e.rid not in seen]
        if rids:
            return rids[0]
        time.sleep(0.005)
    raise AssertionError("no request was admitted")


def _wait_for(cond, state=lambda: None, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"the stage was not reached: {state()}"
        time.sleep(0.005)


@pytest.mark.parametrize("stage", ["before_first_token", "running", "pending_on_peer", "not_streamed"])
def test_disconnect_aborts_and_frees_kv(scripted, stage):
    router, url, app, pair, initial, events = scripted
    delays = {
        "before_first_token": (1.0, 0.0),
        "running": (0.05, 0.05),
        "pending_on_peer": (0.0, 0.4),
        "not_streamed": (0.05, 0.05),
    }[stage]
    pair["small"].delay_s, pair["large"].delay_s = delays
    policy = "hand_to_large" if stage == "pending_on_peer" else "stay_small"
    body = {
        "prompt": "hello",
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "policy": policy,
        "stream": stage != "not_streamed",
    }
    seen = {e.rid for e in list(events) if hasattr(e, "rid")}
    t_close = None
    try:
        if stage in ("before_first_token", "not_streamed"):
            # the client times out (0.3 s) before the first token / before the end, and hangs up
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.3))
            t_close = time.perf_counter()
        else:
            with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                text, lines = "", resp.iter_lines()  # kept open: closing the iterator closes the connection
                while len(text) < 3:
                    line = next(lines)
                    if line.startswith("data: {"):
                        text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
                rid = _new_rid(events, seen)
                if stage == "pending_on_peer":  # small keeps the KV, large owns the request
                    _wait_for(
                        lambda: router.kv_stats()["small"].pending == 1 and router.kv_stats()["large"].owned == 1,
                        lambda: (text, [e for e in events if getattr(e, "rid", None) == rid]),
                    )
                t_close = time.perf_counter()
            # leaving both blocks closes the connection mid-stream
        rid = _new_rid(events, seen)
        _wait_for(lambda: any(type(e).__name__ == "Finished" and e.rid == rid for e in list(events)))
        fin, later, committed = _outcome(events, rid)
        assert fin.reason == "aborted", fin
        assert later == []
        assert committed < 300
        if stage == "before_first_token":
            assert committed == 0
        assert pools_free(router) == initial
        assert router.engine.handles == {} and app.state.tr.active == set()
    finally:
        pair["small"].delay_s = pair["large"].delay_s = 0.0
    assert fin.t - t_close < 2.0  # aborted within a step or two of the disconnect


def test_disconnects_do_not_touch_other_requests(scripted):
    """Several clients hang up at different points while one reads to the end: it gets its whole
    output, and the pools come back."""
    router, url, app, pair, initial, events = scripted
    pair["small"].delay_s = 0.01
    full: dict = {}

    def reader():
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "keep", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "policy": "stay_small"},
            timeout=60,
        )
        full["resp"] = r.json()

    def quitter(n):
        body = {
            "prompt": f"quit {n}",
            "max_tokens": 300,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "policy": "stay_small",
        }
        with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/completions", json=body) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i >= 2 * n:
                    break

    try:
        threads = [threading.Thread(target=reader)] + [threading.Thread(target=quitter, args=(n,)) for n in (1, 3, 6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        text = full["resp"]["choices"][0]["text"]
        assert len(text) == 60 and full["resp"]["usage"]["completion_tokens"] == 60
        assert full["resp"]["tokenrouter"]["finish_reason"] == "length"
        assert pools_free(router) == initial
    finally:
        pair["small"].delay_s = 0.0
