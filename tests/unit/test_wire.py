"""The typed wire: every message and event round-trips through the codec; an unknown one is an
explicit error, in the codec, the sub-server and the engine."""

import dataclasses

import msgspec
import pytest
import torch

from tests.helpers import Alternate
from tokenrouter_sdk.engine import messages
from tokenrouter_sdk.engine.step_result import StepResult, UnknownMessage
from tokenrouter_sdk.engine.transports import codec
from tokenrouter_sdk.engine.transports.wire import load_policy, policy_blob
from tokenrouter_sdk.request import RequestConfig, SamplingParams


class Point:  # user data in a policy state, of a class the codec knows nothing of
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Point) and other.x == self.x


CFG = RequestConfig(
    3,
    [5, 6, 7],
    SamplingParams(
        max_new_tokens=9, temperature=0.7, top_k=4, seed=11, stop=("\n",), stop_token_ids=(2,), logprobs=3, n=2
    ),
    4,
    (0, 1),
    "q-2",
    (8, 9),
)
STATE = {"window": (1, 2), "p": Point(3), "scores": [0.5]}

SAMPLES = {
    messages.Admit: messages.Admit(CFG, 1.5, STATE, ("large",)),
    messages.Prefill: messages.Prefill(CFG, "small"),
    messages.HandoffMsg: messages.HandoffMsg(
        3,
        "small",
        [7, 8],
        messages.RequestState(
            {"small": 5, "large": 5},
            2,
            3,
            1,
            1,
            STATE,
            1,
            "small",
            True,
            torch.tensor([0.25, -1.0], dtype=torch.float64),
        ),
        False,
        CFG,
    ),
    messages.Release: messages.Release(3),
    messages.Abort: messages.Abort(3, "failed", None),
    messages.RegisterPolicy: messages.RegisterPolicy(4, Alternate()),
    messages.UnregisterPolicy: messages.UnregisterPolicy(4),
    messages.Shutdown: messages.Shutdown(),
    messages.ClearPrefixCache: messages.ClearPrefixCache(),
    messages.Go: messages.Go(7),
    messages.SetThresholds: messages.SetThresholds({"small": 2, "large": 1}),
    messages.SetInflight: messages.SetInflight(5),
    messages.StatsQuery: messages.StatsQuery(2),
    messages.Admitted: messages.Admitted(3, "small", 0.5),
    messages.Committed: messages.Committed(3, "large", [9], 2.0, True, [(-0.5, ((9, -0.5), (4, -1.25)))]),
    messages.Hopped: messages.Hopped(3, "small", "large", False, 2.5, 41),
    messages.Resampled: messages.Resampled(3, "small", 12, 4, 3.0),
    messages.Finished: messages.Finished(3, "large", "stop", None, 3.5, "\n", "Traceback ..."),
    messages.StepDone: messages.StepDone(
        model="small",
        t_start=1.0,
        t_end=2.0,
        forward_s=0.75,
        batch_size=2,
        tokens_fed=9,
        fed={3: 4, 8: 5},
        preempted=1,
        round=6,
        kv_used_blocks=10,
        queued=2,
        kv_pending_blocks=3,
        cache_hit_tokens=16,
        cache_query_tokens=32,
        kv_cached_blocks=4,
    ),
    messages.Idle: messages.Idle("large", 7),
    messages.ModelDied: messages.ModelDied("large", "exit code -9", 4.0),
    messages.Stats: messages.Stats("small", 2, 10, 20, 16, 1, 2, 3, 4, True, None, True, 5, 1, 64, 128),
    codec.PolicyBlob: codec.PolicyBlob(4, b"\x80\x05.", "Alternate()", {"f": ("<cell 3>", None)}),
    messages.Retokenized: messages.Retokenized(3, "large", 2, 5, 40, 4.5),
}
# models that do not share a tokenizer: per-model prompts, committed bytes, byte counts, characters
MIXED_CFG = dataclasses.replace(CFG, prompts={"small": [1, 2], "large": [7, 8, 9]})
MIXED = [
    messages.Admit(MIXED_CFG, 1.5, {}, ()),
    messages.HandoffMsg(
        3,
        "small",
        [],
        messages.RequestState(
            {"small": 5, "large": 1},
            2,
            3,
            seen_bytes={"small": 7, "large": 2},
            n_bytes=7,
            units=3,
            unit_at=2,
            unit_base=1,
        ),
        True,
        MIXED_CFG,
        b"\xe4\xbd\xa0a\xe4",
    ),
    messages.Committed(3, "small", [300], 2.0, False, None, 1, None),
    messages.Committed(3, "large", [9], 2.5, True, None, 0, 17),
]


def test_every_message_type_has_a_sample():
    assert set(SAMPLES) == set(codec.MESSAGES)


@pytest.mark.parametrize("cls", codec.MESSAGES, ids=lambda c: c.__name__)
def test_every_message_round_trips(cls):
    msg = SAMPLES[cls]
    back = codec.decode(codec.encode(msg))
    assert type(back) is cls
    for f in dataclasses.fields(cls):
        a, b = getattr(msg, f.name), getattr(back, f.name)
        if isinstance(a, messages.RequestState):
            assert torch.equal(a.peer_logits, b.peer_logits) and b.peer_logits.dtype == a.peer_logits.dtype
            a, b = dataclasses.replace(a, peer_logits=None), dataclasses.replace(b, peer_logits=None)
            assert b == a and type(b.state["window"]) is tuple
        elif isinstance(a, torch.Tensor):
            assert b.dtype == a.dtype and torch.equal(a, b)
        elif f.name == "policy":
            assert type(b) is type(a)
        else:
            assert b == a and type(b) is type(a), f.name


@pytest.mark.parametrize("msg", MIXED, ids=lambda m: type(m).__name__)
def test_the_fields_of_models_without_one_tokenizer_round_trip(msg):
    back = codec.decode(codec.encode(msg))
    assert back == msg and type(back) is type(msg)


def test_a_step_result_round_trips_as_frames():
    res = StepResult(
        [SAMPLES[messages.Committed], SAMPLES[messages.StepDone]],
        [("large", SAMPLES[messages.HandoffMsg]), ("large", messages.Release(3))],
    )
    frames = codec.encode_result(res)
    assert codec.FRAMES[frames[0]] is codec.Frame.RESULT
    events, outgoing = codec.split_result(frames[1:])
    assert [codec.decode(e) for e in events] == res.events
    assert [d for d, _ in outgoing] == ["large", "large"] and codec.decode(outgoing[1][1]) == messages.Release(3)


def test_a_field_of_the_wrong_type_is_refused_by_name():
    bad = codec.encode(messages.Go(1))[:1] + msgspec.msgpack.encode(["one"])
    with pytest.raises(msgspec.ValidationError, match="int"):
        codec.decode(bad)
    with pytest.raises(TypeError, match=r"Go\.round"):
        codec.encode(messages.Go(object()))


def test_an_unknown_message_is_an_explicit_error_in_the_codec():
    class Bogus:
        pass

    with pytest.raises(UnknownMessage, match="unknown type.*Bogus"):
        codec.encode(Bogus())
    with pytest.raises(UnknownMessage, match="unknown tag"):
        codec.decode(bytes([250]) + b"\x90")


def test_a_policy_travels_as_a_blob_and_loads_back():
    blob = codec.decode(codec.encode(policy_blob(4, Alternate())))
    reg = load_policy(blob, "small")
    assert reg.key == 4 and type(reg.policy) is Alternate
    broken = load_policy(codec.PolicyBlob(4, b"not a pickle", "Mine()"), "small")
    with pytest.raises(RuntimeError, match="Mine\\(\\) could not be loaded .* model 'small'"):
        broken.policy.route(None)


def test_the_engine_refuses_an_unknown_event(pair, tok):
    from tokenrouter_sdk import Router

    class Bogus:
        pass

    with Router(pair, Alternate(), tokenizer=tok, processes=False) as r:
        with pytest.raises(UnknownMessage, match="the engine got .*unknown type.*Bogus"):
            r.engine.handle_event(Bogus())
