"""A `SubServer` driven with no transport: feed messages, call `step()`, read the `StepResult`."""

import pytest

from tests.helpers import Alternate, ScriptedRunner, StayOn
from tokenrouter_sdk.engine import messages
from tokenrouter_sdk.engine.config import EngineConfig
from tokenrouter_sdk.engine.core.subserver import SubServer
from tokenrouter_sdk.engine.step_result import StepResult, UnknownMessage
from tokenrouter_sdk.request import RequestConfig, SamplingParams

MODELS = ["small", "large"]


def make(name, script, mode="async", **cfg):
    clock = iter(range(10**6))
    return SubServer(
        name, MODELS, ScriptedRunner(script), None, EngineConfig(mode=mode, **cfg), clock=lambda: float(next(clock))
    )


def request(rid=1, prompt=(5, 6, 7), n=3, key=7):
    return RequestConfig(rid, list(prompt), SamplingParams(max_new_tokens=n, ignore_eos=True), key)


def test_a_step_returns_its_events_in_order_and_nothing_leaves_before():
    ss = make("small", lambda pos: 100 + pos)
    ss.handle(messages.RegisterPolicy(7, StayOn("small")))
    ss.handle(messages.Admit(request(n=2), 0.0))
    assert ss.take() == StepResult()  # handling an admission produces nothing yet
    first = ss.step()
    assert first.ran and first.messages == []
    assert [type(e) for e in first.events] == [messages.Committed, messages.StepDone]
    assert first.events[0].tokens == [103] and not first.events[0].last
    assert first.events[1].fed == {1: 3}
    last = ss.step()
    assert [type(e) for e in last.events] == [
        messages.Committed,
        messages.StepDone,
        messages.Finished,
    ]  # the step is in the trace first
    assert last.events[0].tokens == [104] and last.events[2].reason == "length"
    assert ss.step() == StepResult() and not ss.can_step()
    assert not ss.sched.seqs and ss.sched.blocks.num_free == ss.sched.blocks.num_blocks


def test_a_handoff_is_a_message_of_the_result_and_the_peer_takes_it_without_a_transport():
    small, large = make("small", lambda pos: 100 + pos), make("large", lambda pos: 200 + pos)
    for ss in (small, large):
        ss.handle(messages.RegisterPolicy(7, Alternate()))
    small.handle(messages.Admit(request(n=3, prompt=(5, 6)), 0.0))
    assert small.step().events[0].tokens == [102]  # output position 0 is small's
    res = small.step()  # position 1 is large's: small keeps its token and hands off
    assert [type(e) for e in res.events] == [messages.Committed, messages.Hopped, messages.StepDone]
    assert [(dest, type(m)) for dest, m in res.messages] == [("large", messages.HandoffMsg)]
    msg = res.messages[0][1]
    assert msg.suffix == [5, 6, 102, 103] and msg.request.seen == {"small": 4, "large": 4}
    assert small.sched.seqs[1].status == "pending"  # KV kept while the peer writes
    large.handle(msg)
    res = large.step()  # large writes position 2, the last: the request ends there
    assert res.events[0].tokens == [204] and res.events[0].last
    assert [type(e) for e in res.events] == [messages.Committed, messages.StepDone, messages.Finished]
    assert res.messages == [("small", messages.Release(1))]
    small.handle(res.messages[0][1])
    assert not large.sched.seqs and not small.sched.seqs
    assert small.sched.blocks.num_free == small.sched.blocks.num_blocks


def test_gated_modes_step_only_on_go_and_answer_idle():
    ss = make("small", lambda pos: 100 + pos, mode="sync")
    ss.handle(messages.RegisterPolicy(7, StayOn("small")))
    assert ss.step() == StepResult()
    ss.handle(messages.Go(1))
    idle = ss.step()
    assert idle.events == [messages.Idle("small", 1)] and not idle.ran
    ss.handle(messages.Admit(request(n=1), 0.0))
    assert ss.step() == StepResult()  # no Go: no step
    ss.handle(messages.Go(2))
    res = ss.step()
    assert res.ran and res.events[1].round == 2 and res.events[-1].reason == "length"


def test_handled_messages_answer_through_take():
    ss = make("small", lambda pos: 100 + pos)
    ss.handle(messages.StatsQuery(5))
    ss.handle(messages.Abort(9))
    ss.handle(messages.Admit(request(rid=9), 0.0))  # aborted before it arrived
    res = ss.take()
    assert [type(e) for e in res.events] == [messages.Stats, messages.Finished]
    assert res.events[0].token == 5 and res.events[1].reason == "aborted"
    ss.handle(messages.Shutdown())
    assert not ss.running and not ss.can_step()


def test_an_unknown_message_is_an_error_naming_its_type():
    class Bogus:
        pass

    ss = make("small", lambda pos: 100 + pos)
    with pytest.raises(UnknownMessage, match="small.*unknown type.*Bogus"):
        ss.handle(Bogus())


def test_no_module_outside_the_engine_reads_a_private_name_of_it():
    import re
    from pathlib import Path

    import tokenrouter_sdk

    root = Path(tokenrouter_sdk.__file__).parent
    private = re.compile(r"\b(engine|transport|subservers\[[^]]+\]|ss|call|handle)\._[a-z]\w*")
    hits = [
        f"{p.relative_to(root)}:{i}: {line.strip()}"
        for p in root.rglob("*.py")
        if "engine" not in p.parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert hits == []
