"""A ``--policy-file`` class runs in sub-server processes (the default transport for two torch
models) as it does in threads: ``serve`` answers with it and ``eval`` scores it; a policy that
cannot be shipped stops the command at start, naming the fix; a stand-in for a policy a child
could not load names the hook the user wrote."""

import argparse
import json

import pytest

from tokenrouter_sdk import Policy, Router

from ..helpers import save_tiny_pair

pytestmark = pytest.mark.timeout(300)

POLICY_FILE = """
from tokenrouter_sdk import Policy


def _writer(position, start):
    return (position + start) % 2


class EveryOther(Policy):
    def __init__(self, start: int = 0):
        self.start = start

    def route(self, step):
        return step.models[_writer(step.position, self.start)]
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("ship_models"))


@pytest.fixture
def processes(monkeypatch):
    """The real default transport: processes for two torch models (the unit tier sets threads)."""
    monkeypatch.delenv("TOKENROUTER_PROCESSES", raising=False)


def _flags(folders, tmp_path):
    (tmp_path / "every_other.py").write_text(POLICY_FILE)
    return [
        "--model",
        f"small={folders[0]}",
        "--model",
        f"large={folders[1]}",
        "--policy-file",
        f"{tmp_path / 'every_other.py'}:EveryOther",
    ]


def test_serve_answers_with_a_policy_file_class_in_sub_server_processes(folders, tmp_path, processes):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tokenrouter_sdk.cli.serve import add_parser, build
    from tokenrouter_sdk.engine.transports.process_transport import ProcessTransport

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd", required=True))
    args = p.parse_args(["serve", *_flags(folders, tmp_path), "--max-kv-tokens", "512"])
    router, app, sock, _ = build(args)
    try:
        assert isinstance(router.engine.transport, ProcessTransport)
        with TestClient(app) as client:
            r = client.post(
                "/v1/completions",
                json={
                    "model": "tokenrouter",
                    "prompt": [5, 6, 7],
                    "max_tokens": 6,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )
            assert r.status_code == 200, r.text
        assert r.json()["tokenrouter"]["writers"] == ["small", "large"] * 3
    finally:
        sock.close()
        router.close()


def test_eval_scores_a_policy_file_class_in_sub_server_processes(folders, tmp_path, processes):
    from tokenrouter_sdk.cli.eval import add_arguments, cmd_eval

    out = tmp_path / "eval"
    argv = [
        *_flags(folders, tmp_path),
        "--param",
        "start",
        "--values",
        "0",
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
        "--references",
        "large_only",
        "--repeats",
        "1",
        "--no-progress",
        "--concurrency",
        "2",
        "--out",
        str(out),
    ]
    assert cmd_eval(add_arguments(argparse.ArgumentParser()).parse_args(argv)) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["router"]["transport"] == "ProcessTransport"
    (point,) = [r for r in res["records"] if r["kind"] == "sweep"]
    assert point["failed"] == 0 and point["answered"] == 2 and point["large_fraction"] == 0.5
    assert all(a["error"] is None for a in res["answers"][point["label"]])


class _HoldsALock(Policy):
    def __init__(self):
        import threading

        self.lock = threading.Lock()


def test_a_policy_that_cannot_be_shipped_stops_the_command_naming_the_fix():
    from tokenrouter_sdk.cli.common import check_shippable

    with pytest.raises(SystemExit) as e:
        check_shippable(_HoldsALock(), "tokenrouter serve")
    msg = str(e.value)
    assert msg.startswith("tokenrouter serve: ") and "_HoldsALock" in msg and "--transport thread" in msg
    check_shippable(Policy(), "tokenrouter serve")  # a shippable one passes


def test_a_policy_the_children_cannot_load_fails_in_route_not_route_batch(pair, tok, tmp_path, monkeypatch):
    """A stand-in for a policy the child could not load fails each request in the hook the user
    wrote (route), not in route_batch, which the user never wrote."""
    from tokenrouter_sdk.engine.transports.codec import PolicyBlob
    from tokenrouter_sdk.engine.transports.wire import load_policy

    stand_in = load_policy(PolicyBlob(1, b"not a pickle", "Mine()", {}), "small").policy
    assert type(stand_in).route_batch is Policy.route_batch
    with Router(pair, stand_in, tokenizer=tok) as r:
        out = r.generate([[5, 6, 7]], max_new_tokens=3)[0]
    assert out.finish_reason == "failed" and "could not be loaded" in out.error
    assert "route_batch" not in out.error and ".route raised" in out.error


class _Raises(Policy):
    def route(self, step):
        raise RuntimeError("route is broken")


def test_a_failed_request_is_logged_by_the_server(pair, tok, caplog):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tokenrouter_sdk.serve.app import create_app

    with Router(pair, tokenizer=tok) as r, TestClient(create_app(r, policy=_Raises())) as client:
        with caplog.at_level("WARNING", logger="tokenrouter.serve"):
            resp = client.post("/v1/completions", json={"model": "tokenrouter", "prompt": [5, 6, 7], "max_tokens": 3})
    assert resp.status_code == 500 and "route is broken" in resp.json()["error"]["message"]
    assert any("answered 500" in m and "route is broken" in m for m in caplog.messages)
