"""A server restarts a sub-server that died (`create_app(restart_limit=...)`, ``tokenrouter serve
--restart-limit``): the requests it held fail with the reason, a log line says it restarts and one
that it serves again, ``/health`` turns 200 and requests are served; past the limit it is not
restarted, the log says so and ``/health`` stays 503."""

import logging
import os
import signal
import time

import httpx
import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate
from tokenrouter_sdk.policies import RandomRouting

from .conftest import serving

BODY = {"prompt": "hi", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _health(url, want: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=30)
        if h.status_code == want or time.monotonic() > deadline:
            assert h.status_code == want, h.text
            return h.json()
        time.sleep(0.1)


def _wait(cond, caplog, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)


def test_a_killed_sub_server_is_restarted_by_the_server_up_to_its_limit(caplog):
    large = tiny_model(num_layers=2, seed=5)
    pair = {"small": truncate(large, 1), "large": large}
    caplog.set_level(logging.WARNING, logger="tokenrouter.serve")
    with (
        Router(pair, RandomRouting(p=0.5, seed=1), tokenizer=tiny_tokenizer(), processes=True) as router,
        serving(router, restart_limit=1) as (url, app),
    ):
        tr = router.engine.transport
        first = tr.pids()["large"]
        os.kill(first, signal.SIGKILL)
        _wait(lambda: app.state.tr.restarts.history, caplog)
        assert _health(url, 200)["models"]["large"]["alive"]
        second = tr.pids()["large"]
        assert second != first
        text = caplog.text
        assert "sub-server 'large' died (sub-server process 'large' died (exit code -9, killed by SIGKILL))" in text
        assert "restarting it (1 of 1)" in text and "sub-server 'large' restarted in" in text
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        assert "large" in r.json()["tokenrouter"]["writers"]  # the new large sub-server wrote
        assert [h["action"] for h in app.state.tr.restarts.history] == ["restarted"]

        os.kill(second, signal.SIGKILL)  # past the limit: stays dead
        h = _health(url, 503)
        assert h["models"]["large"]["alive"] is False and "SIGKILL" in h["models"]["large"]["error"]
        _wait(lambda: "not restarting it: 1 restart(s) done, the limit is 1" in caplog.text, caplog)
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=60).status_code == 503
        assert tr.pids()["large"] == second


def test_a_bad_restart_limit_is_refused():
    from tokenrouter_sdk.serve.app import create_app

    with Router(
        {"small": tiny_model(num_layers=1, seed=2), "large": tiny_model(num_layers=1, seed=3)},
        tokenizer=tiny_tokenizer(),
    ) as router:
        with pytest.raises(ValueError, match="restart limit must be an int >= 0"):
            create_app(router, restart_limit=-1)
