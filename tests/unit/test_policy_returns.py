"""What a policy's hooks return is checked at the boundary: a wrong type or value fails only that
request, with an error naming the policy, the hook, the value and what is accepted, in threads
and in processes, and the Router serves the next call. Each request's decision is computed once
per step, also when a batch-mate's `route` raises."""

import os

import pytest

from tokenrouter_sdk import Handoff, Policy, Router, SamplingParams
from tokenrouter_sdk.engine.front.engine import EngineDeadError
from tokenrouter_sdk.reference import reference_generate

from ..helpers import pools_free

pytestmark = pytest.mark.timeout(240)

GOOD = [[5, 6, 7], [9, 10]]
BAD = [99, 3, 4]
N_NEW = 6


class Foreign:
    """An object of no type a hook accepts."""

    def __repr__(self):
        return "Foreign()"


def _span(value):
    """A Handoff whose span was set to ``value`` after it was built."""
    h = Handoff(keep_sampled=True)
    h.span = value
    return h


# hook -> (label, value) pairs: what the hook returns for the request whose prompt starts with 99
CASES = {
    "entry": [("bool", True), ("int", 2), ("str", "2"), ("foreign", Foreign()), ("handoff", Handoff())],
    "may_use": [("bool", True), ("int", 2), ("str", "large"), ("unknown", ["2"]), ("foreign", Foreign())],
    "route": [
        ("int", 2),
        ("str", "2"),
        ("foreign", Foreign()),
        ("none", None),
        ("handoff", Handoff()),
        ("list", ["large"]),
    ],
    "route_batch": [("bool", True), ("int", 2), ("str", "2"), ("foreign", Foreign()), ("short", []), ("item", "item")],
    "send": [
        ("bool", True),
        ("false", False),
        ("int", 2),
        ("str", "2"),
        ("foreign", Foreign()),
        ("span_str", _span("2")),
        ("span_neg", _span(-1)),
        ("span_float", _span(1.5)),
    ],
    "receive": [("bool", True), ("int", 2), ("str", "2"), ("foreign", Foreign())],
}
ALL = [(hook, label) for hook, cases in CASES.items() for label, _ in cases]


class Misbehave(Policy):
    """Hands every request to the large model at position 1 (keeping the token) and back at 3;
    for the request whose prompt starts with 99, hook ``hook`` returns ``value``."""

    def __init__(self, hook, value):
        self.hook, self.value = hook, value

    def _bad(self, req):
        return req.prompt_ids[0] == 99

    def entry(self, req, models):
        return self.value if self.hook == "entry" and self._bad(req) else None

    def may_use(self, req, models):
        return self.value if self.hook == "may_use" and self._bad(req) else list(models)

    def route(self, step):
        if self.hook == "route" and self._bad(step.request) and step.position == 1:
            return self.value
        if step.position in (1, 3):
            return step.models[1 - step.models.index(step.model)]
        return step.model

    def route_batch(self, batch):
        out = super().route_batch(batch)
        if self.hook != "route_batch" or not any(self._bad(r) for r in batch.requests):
            return out
        if self.value == "item":  # one wrong item: only its request fails
            return [Foreign() if self._bad(r) else d for r, d in zip(batch.requests, out)]
        return self.value  # a wrong container: the whole batch fails

    def send(self, req, target):
        if self.hook == "send" and self._bad(req):
            return self.value
        return Handoff(keep_sampled=True)

    def receive(self, handoff, req):
        return self.value if self.hook == "receive" and self._bad(req) else None


def _value(hook, label):
    return dict(CASES[hook])[label]


def _check(router, hook, label):
    """One call with the misbehaving request among good ones, then a good call."""
    value = _value(hook, label)
    alone = hook == "route_batch" and label != "item"  # a wrong container fails its whole batch
    prompts = [BAD] if alone else [GOOD[0], BAD, GOOD[1]]
    pol = Misbehave(hook, value)
    outs = router.generate(prompts, policy=pol, max_new_tokens=N_NEW, ignore_eos=True, timeout=60)
    bad = outs[0] if alone else outs[1]
    err = bad.error or ""
    assert bad.finish_reason == "failed", (hook, label, bad.finish_reason)
    assert "Misbehave" in err and f".{hook}" in err, err
    shown = {"foreign": "Foreign()", "item": "Foreign()", "short": "0 decisions"}.get(label, repr(value))
    if "span" in label:
        shown = repr(value.span)
    assert shown in err, (shown, err)
    assert "accepted" in err or "must be" in err, err
    for o in outs:
        if o is not bad:
            assert o.finish_reason == "length" and len(o.token_ids) == N_NEW, (hook, label, o.error)
            assert o.hops == 2, (hook, label, o.hops)
    # the Router serves the next call
    again = router.generate(GOOD, policy=Misbehave("none", None), max_new_tokens=N_NEW, ignore_eos=True, timeout=60)
    assert all(o.finish_reason == "length" and o.hops == 2 for o in again), [o.error for o in again]


@pytest.mark.parametrize("hook,label", ALL)
def test_wrong_return_fails_only_its_request_in_threads(pair, tok, hook, label):
    with Router(pair, tokenizer=tok, prefill_peers=True) as r:
        _check(r, hook, label)
        assert all(free == usable for free, usable in pools_free(r).values())
        assert not r.engine.dead


@pytest.fixture(scope="module")
def process_router(pair, tok):
    saved = os.environ.pop("TOKENROUTER_PROCESSES", None)
    try:
        r = Router(pair, tokenizer=tok, processes=True, prefill_peers=True)
    finally:
        if saved is not None:
            os.environ["TOKENROUTER_PROCESSES"] = saved
    yield r
    r.close()


def test_wrong_returns_fail_only_their_requests_in_processes(process_router):
    r = process_router
    for hook, label in ALL:
        try:
            _check(r, hook, label)
        except EngineDeadError as e:  # a sub-server died: say which case killed it
            raise AssertionError(f"{hook} returning {label} killed a sub-server: {e}") from e
    assert not r.engine.dead


def test_handoff_checks_its_fields_when_built():
    for kw, word in (
        ({"span": "2"}, "span"),
        ({"span": 0}, "span"),
        ({"span": True}, "span"),
        ({"keep_sampled": 1}, "keep_sampled"),
        ({"greedy": "yes"}, "greedy"),
    ):
        with pytest.raises((TypeError, ValueError), match=f"Handoff.{word}"):
            Handoff(**kw)
    assert Handoff(span=3).span == 3


def test_send_building_a_bad_handoff_fails_its_request_at_the_users_line(pair, tok):
    class BuildsBadSpan(Misbehave):
        def send(self, req, target):
            if self._bad(req):
                return Handoff(keep_sampled=True, span="2")
            return Handoff(keep_sampled=True)

    with Router(pair, tokenizer=tok) as r:
        outs = r.generate(
            [GOOD[0], BAD, GOOD[1]], policy=BuildsBadSpan("none", None), max_new_tokens=N_NEW, ignore_eos=True
        )
    err = outs[1].error
    assert outs[1].finish_reason == "failed"
    assert "BuildsBadSpan" in err and ".send raised TypeError" in err and "Handoff.span" in err and "'2'" in err
    assert __file__.replace(".pyc", ".py") in err  # the line of the policy's code
    assert outs[0].ok and outs[2].ok


def test_bool_with_three_models_fails_its_request(trio, tok):
    class Flip(Policy):
        def route(self, step):
            return True if step.request.prompt_ids[0] == 99 else step.model

    with Router(trio, Flip(), tokenizer=tok) as r:
        outs = r.generate([GOOD[0], BAD], max_new_tokens=N_NEW, ignore_eos=True)
    assert outs[0].ok
    assert outs[1].finish_reason == "failed" and "a bool names a model only with two models" in outs[1].error


def test_policy_class_instead_of_instance(pair, tok):
    class MyPolicy(Policy):
        def route(self, step):
            return step.model

    with pytest.raises(TypeError, match=r"policy=.*MyPolicy is the class, not an instance: pass .*MyPolicy\(\.\.\.\)"):
        Router(pair, MyPolicy, tokenizer=tok)
    with Router(pair, tokenizer=tok) as r:
        with pytest.raises(TypeError, match="is the class, not an instance"):
            r.generate(GOOD, policy=MyPolicy, max_new_tokens=3)
        with pytest.raises(TypeError, match="build_policy"):
            r.generate(GOOD, policy="rstitch", max_new_tokens=3)
        bad_needs = MyPolicy()
        bad_needs.needs = True
        with pytest.raises(TypeError, match="needs must be a tokenrouter_sdk.Needs"):
            r.generate(GOOD, policy=bad_needs, max_new_tokens=3)
        assert all(o.ok for o in r.generate(GOOD, policy=MyPolicy(), max_new_tokens=3))


class CountingHops(Policy):
    """Stateful: counts its route calls per request in ``step.state`` and hands off on every
    third one (keeping the token), so a second call at a position changes where it hops; logs
    every (prompt head, position, model) it routes to ``log`` (a file, shared by processes)."""

    def __init__(self, log):
        self.log = log

    def route(self, step):
        with open(self.log, "a") as f:
            f.write(f"{step.request.prompt_ids[0]} {step.position} {step.model}\n")
        if step.request.prompt_ids[0] == 99 and step.position == 2:
            raise ZeroDivisionError("a batch-mate fails")
        step.state["n"] = step.state.get("n", 0) + 1
        return step.state["n"] % 3 == 0

    def send(self, req, target):
        return Handoff(keep_sampled=True)


@pytest.mark.parametrize("where", ["threads", "processes"])
def test_route_runs_once_per_position_when_a_batch_mate_raises(pair, tok, tmp_path, where, process_router):
    log = tmp_path / "route.log"
    pol = CountingHops(str(log))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [GOOD[0], BAD, GOOD[1], [40, 41, 42, 43]]
    if where == "threads":
        with Router(pair, tokenizer=tok) as r:
            outs = r.generate(prompts, policy=pol, sampling=params)
    else:
        outs = process_router.generate(prompts, policy=pol, sampling=params, timeout=60)
    assert outs[1].finish_reason == "failed" and "a batch-mate fails" in outs[1].error
    seen: dict = {}
    for line in log.read_text().split("\n"):
        if line:
            head, pos, model = line.split()
            seen.setdefault(int(head), []).append(int(pos))
    for p, o in zip(prompts, outs):
        if p is BAD:
            assert seen[99] == [0, 1, 2]
            continue
        assert seen[p[0]] == list(range(12)), (p[0], seen[p[0]])  # each position routed exactly once
        log.write_text("")
        ref = reference_generate(pair, p, CountingHops(str(log)), params, rid=o.rid)
        assert (o.token_ids, o.token_models, o.hops) == (ref["token_ids"], ref["token_models"], ref["hops"])
        assert o.hops >= 3


def test_route_batch_that_raises_fails_its_batch_once(pair, tok):
    calls = []

    class Vector(Policy):
        def route_batch(self, batch):
            calls.append(len(batch))
            for req in batch.requests:
                req.state["n"] = req.state.get("n", 0) + 1
            if any(r.prompt_ids[0] == 99 for r in batch.requests) and batch.requests[0].n_generated == 2:
                raise ValueError("vectorised failure")
            return [batch.model] * len(batch)

        def route(self, step):
            raise AssertionError("route must not run: route_batch is the policy's decision")

    with Router(pair, Vector(), tokenizer=tok) as r:
        outs = r.generate([GOOD[0], BAD, GOOD[1]], max_new_tokens=N_NEW, ignore_eos=True)
        assert pools_free(r) and not r.engine.dead
        assert all(o.ok for o in r.generate(GOOD, policy=Policy(), max_new_tokens=3))
    failed = [o for o in outs if o.finish_reason == "failed"]
    assert failed and all("route_batch raised ValueError: vectorised failure" in o.error for o in failed)
    assert all("requests of this batch fail with it" in o.error for o in failed)
    assert calls[:3] == [3, 3, 3]  # one call per step, never one per request after the failure


class LargeEntryOneArgument(Policy):
    """``entry`` written with the request alone (the models are also on ``req.models``)."""

    def entry(self, req):
        return req.models[-1]


def test_entry_written_with_the_request_alone_works(pair, tok):
    """`Policy.entry` is ``entry(req, models)``; an override that takes only ``req`` is called
    with it alone, in the engine and in the naive reference."""
    pol = LargeEntryOneArgument()
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with Router(pair, pol, tokenizer=tok) as r:
        out = r.generate([GOOD[0]], sampling=params)[0]
    assert out.error is None and out.token_models == ["large"] * 4
    assert reference_generate(pair, GOOD[0], pol, params, rid=out.rid)["token_ids"] == out.token_ids
