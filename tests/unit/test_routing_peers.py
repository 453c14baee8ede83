"""The pure pieces of ``evals/throughput/routing_peers.py`` (no vLLM needed): the schedule function
gives the writer sequence and hops `RandomSpanRouting` realises in the engine, and the request-level
dispatcher sends each position to the model the schedule names and commits what it returns."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.policies import RandomSpanRouting

SCRIPT = Path(__file__).resolve().parents[2] / "evals" / "throughput" / "routing_peers.py"


@pytest.fixture(scope="module")
def rp():
    spec = importlib.util.spec_from_file_location("routing_peers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_schedule_is_what_the_engine_realises(rp, pair, tok, mode):
    kw = {"large_visit": 3.5, "small_visit": 2.0, "seed": 5}  # short stretches: many visits in few tokens
    prompts = [[5 + i, 9, 11 + 2 * i] for i in range(6)]
    keys = list(range(6))
    with Router(pair, tokenizer=tok, mode=mode) as r:
        outs = r.generate(
            prompts, policy=RandomSpanRouting(**kw), max_new_tokens=24, ignore_eos=True, keys=keys, concurrency=3
        )
    want = [rp.span_schedule(k, 24, **kw) for k in keys]
    got = [("".join(rp.CODE[m] for m in o.token_models), o.hops) for o in outs]
    assert got == want
    writers = [w for w, _ in want]
    assert any("L" in w for w in writers) and any("S" in w for w in writers)
    assert any("LL" in w for w in writers), "spans longer than one token are covered"
    # the writer sequence of a key does not depend on the output length (a prefix of a longer one)
    assert rp.span_schedule(3, 10, **kw)[0] == rp.span_schedule(3, 24, **kw)[0][:10]


def test_schedule_edges(rp):
    assert rp.span_schedule(0, 16, small_visit=float("inf")) == ("S" * 16, 0)
    w, hops = rp.span_schedule(1, 50, large_visit=float("inf"), small_visit=0.0)
    assert w == "L" * 50 and hops == 1  # hands off at once and never comes back
    assert rp.writer_changes("SSLLSL") == 3 and rp.writer_changes("") == 0
    assert rp.run_length("SSLLLS", 2) == 3 and rp.run_length("SSLLLS", 5) == 1


class FakeEngine:
    """A request-level engine that writes ``base + position`` for each new token, recording every
    call's contexts and counts."""

    def __init__(self, base: int):
        self.base, self.calls = base, []

    def __call__(self, contexts, counts):
        self.calls.append((contexts, counts))
        return [[self.base + len(c) + j for j in range(k)] for c, k in zip(contexts, counts)]


@pytest.mark.parametrize("unit", ["token", "span"])
def test_dispatcher_commits_each_position_on_the_scheduled_model(rp, unit):
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    writers = ["SSLLS", "LLLLL", "SLSLS", "SSSSS"]
    small, large = FakeEngine(1000), FakeEngine(2000)
    d = rp.dispatch({"small": small, "large": large}, prompts, writers, concurrency=2, unit=unit)
    assert d["writers"] == writers
    for p, w, out in zip(prompts, writers, d["tokens"]):
        # position j was written by its scheduled model, from a context of prompt + j committed tokens
        assert out == [(2000 if c == "L" else 1000) + len(p) + j for j, c in enumerate(w)]
    for eng, code in ((small, "S"), (large, "L")):
        for contexts, counts in eng.calls:
            assert len(contexts) <= 2  # never more requests in flight than the concurrency
            for ctx, k in zip(contexts, counts):
                i = next(i for i, p in enumerate(prompts) if ctx[: len(p)] == p)
                pos = len(ctx) - len(prompts[i])
                assert ctx[len(prompts[i]) :] == d["tokens"][i][:pos]  # the whole committed context
                assert writers[i][pos : pos + k] == code * k
                assert k == (1 if unit == "token" else rp.run_length(writers[i], pos))
    if unit == "token":
        # every round sends one token per request in flight: rounds = output length per wave
        assert d["rounds"] == 10 and sum(len(c) for c, _ in small.calls + large.calls) == 20
    assert len(d["latency_s"]) == 4 and all(x >= 0 for x in d["latency_s"])


def test_dispatcher_refuses_a_short_answer(rp):
    with pytest.raises(RuntimeError, match="asked for 1"):
        rp.dispatch({"small": lambda c, k: [[] for _ in c], "large": FakeEngine(0)}, [[1]], ["S"], concurrency=1)
