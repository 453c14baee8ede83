"""The policy host on its own (no engine, no model): the plain decisions it hands back, and how it
words a hook that raises or returns what it may not (the policy, the hook, the value, the model,
the request)."""

import torch

from tokenrouter_sdk.engine.core.policy_host import PolicyHost, RequestFailed
from tokenrouter_sdk.engine.core.scheduler import Seq
from tokenrouter_sdk.policy import Handoff, Policy, Resample
from tokenrouter_sdk.request import RequestConfig, RequestView, SamplingParams

MODELS = ["small", "large"]


class Scripted(Policy):
    """Returns (or raises) what it is given, per hook."""

    def __init__(self, **out):
        self.out = out

    def __repr__(self):
        return "Scripted()"

    def _give(self, hook, default):
        v = self.out.get(hook, default)
        if isinstance(v, BaseException):
            raise v
        return v(self) if callable(v) else v

    def entry(self, req, models):
        return self._give("entry", None)

    def may_use(self, req, models):
        return self._give("may_use", list(models))

    def route(self, step):
        return self._give("route", step.model)

    def send(self, req, target):
        return self._give("send", Handoff())


def seq(rid, key=3, committed=0):
    s = Seq(RequestConfig(rid, [5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True), key), [5, 6, 7])
    s.request_state.seen = {"small": 3}
    s.request_state.n_committed = committed
    return s


def route(host, batch, draw=None, limit=4):
    n = len(batch)
    logits, hidden = torch.zeros(n, 16, dtype=torch.float64), torch.zeros(n, 4, dtype=torch.float64)
    drawn = []
    decisions = host.decide(
        batch,
        [1] * n,
        logits,
        hidden,
        [None] * n,
        draw or (lambda rows: [2] * len(rows)),
        lambda s, tok: drawn.append((s.rid, tok)),
        limit,
    )
    return decisions, drawn


def view(owner=""):
    return RequestView(
        rid=11, prompt_ids=[5, 6, 7], output_ids=[], owner=owner, state={}, hops=0, models=tuple(MODELS), key=0
    )


def test_submission_hooks_give_the_entry_and_peers_or_the_error_that_fails_the_request():
    host = PolicyHost("", MODELS)
    assert host.entry(Scripted(entry="large"), view()) == ("large", None)
    assert host.entry(Scripted(), view()) == ("small", None)  # None: the first model
    assert host.entry(Scripted(entry=7), view()) == (
        "small",
        "policy Scripted().entry returned 7 (int); accepted: one of ['small', 'large'] (the model that "
        "prefills the request) or None (the first model, 'small') (request 11)",
    )
    assert host.entry(Scripted(entry=KeyError("k")), view()) == (
        "small",
        "policy Scripted().entry raised KeyError: 'k' (request 11)",
    )
    assert host.may_use(Scripted(may_use=["large", "small"]), view("small")) == (("large",), None)
    peers, error = host.may_use(Scripted(may_use="large"), view("small"))
    assert peers == () and error.startswith("policy Scripted().may_use returned 'large' (str); accepted: a list")


def test_route_decisions_are_plain_and_a_bad_return_fails_only_its_request_naming_policy_hook_and_request():
    host = PolicyHost("small", MODELS)
    host.add(3, Scripted(route=lambda p: "large"))
    host.add(4, Scripted(route=7))
    a, b, c = seq(1, key=3), seq(2, key=4), seq(3, key=9)  # key 9: no policy registered
    decisions, _ = route(host, [a, b, c])
    assert decisions[0] == "large"
    assert isinstance(decisions[1], RequestFailed) and decisions[1].args == (
        "policy Scripted().route returned 7 (int); accepted: one of ['small', 'large'] (the model that writes next; "
        "its own name to stay), a bool (True hands off to the other model) or Resample() (on model 'small' at "
        "output position 0 of request 2)",
    )
    assert decisions[2].args == ("request 3: its policy is no longer registered",)


def test_resample_is_carried_out_by_the_host_until_a_draw_stands_or_the_limit():
    host = PolicyHost("small", MODELS)
    calls = []

    def twice(p):
        calls.append(1)
        return Resample() if len(calls) <= 2 else "small"

    host.add(3, Scripted(route=twice))
    host.add(4, Scripted(route=Resample()))
    a, b = seq(1, key=3), seq(2, key=4)
    decisions, drawn = route(host, [a, b], limit=2)
    assert decisions[0] == "small" and a.request_state.discarded == 2
    assert drawn[:2] == [(1, 1), (2, 1)]  # the first draws are discarded and reported
    assert isinstance(decisions[1], RequestFailed)
    assert decisions[1].args[0] == (
        "policy Scripted() resampled output position 0 of request 2 3 times in a row "
        "on model 'small'; let a draw stand (return the model) after at most 2"
    )


def test_send_and_receive_word_the_failure_and_the_traceback_names_the_policy_line():
    host = PolicyHost("small", MODELS)
    host.add(3, Scripted(send=lambda p: 1 / 0))
    s = seq(5, key=3, committed=2)
    try:
        host.send(s, "large")
    except RequestFailed as e:
        msg, tb = e.args
    else:
        raise AssertionError("send raised nothing")
    assert msg.startswith("policy Scripted().send raised ZeroDivisionError: division by zero at ")
    assert __file__ in msg and msg.endswith(" on model 'small' at output position 2 of request 5")
    assert "ZeroDivisionError" in tb
    host.add(4, Scripted())
    assert host.receive(seq(6, key=4), keep_sampled=True) is None
    host.remove(4)
    msg, _ = host.receive(seq(6, key=4), keep_sampled=True)
    assert msg.startswith("policy None.receive raised RuntimeError: the request's policy is no longer registered")
