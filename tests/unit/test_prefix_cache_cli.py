"""``--no-prefix-cache`` reaches the Router of every command that builds one (demo, bench, eval,
serve); without it the cache stays on."""

import pytest

from tokenrouter_sdk.cli.main import build_parser
from tokenrouter_sdk.router import Router


class Built(Exception):
    pass


@pytest.fixture
def captured(monkeypatch):
    """Router.default and Router() record their keyword arguments and stop the command there."""
    got = {}

    def default(cls, *a, **kw):
        got.update(kw)
        raise Built

    def init(self, *a, **kw):
        got.update(kw)
        raise Built

    monkeypatch.setattr(Router, "default", classmethod(default))
    monkeypatch.setattr(Router, "__init__", init)
    return got


@pytest.mark.parametrize("flag", [[], ["--no-prefix-cache"]])
def test_demo_and_serve(captured, flag):
    for argv in (["demo", "-n", "1"], ["serve"]):
        args = build_parser().parse_args(argv + flag)
        captured.clear()
        with pytest.raises(Built):
            args.fn(args)
        assert captured.get("prefix_cache", True) is (not flag), argv


@pytest.mark.parametrize("flag", [[], ["--no-prefix-cache"]])
def test_eval(monkeypatch, flag, tmp_path):
    got = {}

    def fake(*a, router_kwargs=None, **kw):
        got.update(router_kwargs)
        raise Built

    import tokenrouter_sdk.eval as ev

    monkeypatch.setattr(ev, "evaluate_policy", fake)
    args = build_parser().parse_args(["eval", "--limit", "1", "--out", str(tmp_path)] + flag)
    with pytest.raises(Built):
        args.fn(args)
    assert got["prefix_cache"] is (not flag)


@pytest.mark.parametrize("flag", [[], ["--no-prefix-cache"]])
def test_bench(monkeypatch, flag, tmp_path):
    got = {}

    def fake(*a, **kw):
        got.update(kw)
        raise Built

    import tokenrouter_sdk.bench as b

    monkeypatch.setattr(b, "run_bench", fake)
    args = build_parser().parse_args(["bench", "--backend", "sim", "--out", str(tmp_path / "b")] + flag)
    with pytest.raises(Built):
        args.fn(args)
    assert got.get("prefix_cache", True) is (not flag)
