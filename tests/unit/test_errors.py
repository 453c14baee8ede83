"""Bad input: a clear error naming the problem and the fix, and no harm to other requests."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tokenrouter_sdk import Policy, Router, SamplingParams
from tokenrouter_sdk.models import TokenizerMismatchError, tiny_model
from tokenrouter_sdk.policies import RandomRouting

from ..helpers import pools_free

GOOD = [[5, 6, 7], [9, 10]]


def check_others_ok(outs, bad_index):
    for i, o in enumerate(outs):
        if i != bad_index:
            assert o.finish_reason == "length" and len(o.token_ids) == 6, (i, o.error)


def test_empty_prompt(pair, tok):
    with Router(pair, RandomRouting(0.3), tokenizer=tok) as r:
        outs = r.generate([GOOD[0], "", GOOD[1], []], max_new_tokens=6, ignore_eos=True)
    assert outs[1].finish_reason == "failed" and "empty" in outs[1].error
    assert outs[3].finish_reason == "failed" and "empty" in outs[3].error
    assert outs[0].ok and outs[2].ok and len(outs[0].token_ids) == 6


def test_prompt_longer_than_context(pair, tok):
    ctx = pair["large"].config.max_position_embeddings
    with Router(pair, RandomRouting(0.3), tokenizer=tok) as r:
        outs = r.generate([GOOD[0], [7] * (ctx + 5), GOOD[1]], max_new_tokens=6, ignore_eos=True)
    assert outs[1].finish_reason == "failed"
    assert f"{ctx + 5} tokens" in outs[1].error and f"context is {ctx}" in outs[1].error
    check_others_ok(outs, 1)


def test_generation_stops_at_context_end(pair, tok):
    ctx = pair["large"].config.max_position_embeddings
    with Router(pair, RandomRouting(0.3), tokenizer=tok) as r:
        out = r.generate([[7] * (ctx - 3)], max_new_tokens=50, ignore_eos=True)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_max_new_tokens_not_positive(pair, tok):
    with Router(pair, RandomRouting(0.3), tokenizer=tok) as r:
        with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
            r.generate(GOOD, max_new_tokens=0)
        outs = r.generate(
            GOOD + [[11, 12]],
            sampling=[
                SamplingParams(max_new_tokens=6, ignore_eos=True),
                SamplingParams(max_new_tokens=6, ignore_eos=True),
                SamplingParams(max_new_tokens=-1),
            ],
        )
    assert outs[2].finish_reason == "failed" and "max_new_tokens" in outs[2].error
    check_others_ok(outs, 2)


def test_sampling_values_are_validated_once(pair, tok, monkeypatch):
    """One check per SamplingParams given: a global one raises at once, one of a list fails its
    request alone (after the prompt's own error, which comes first)."""
    calls = []
    real = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda self: calls.append(self) or real(self))
    with Router(pair, RandomRouting(0.3), tokenizer=tok) as r:
        shared = SamplingParams(max_new_tokens=3)
        assert len(r.requests(GOOD * 2, sampling=shared)) == 4 and calls == [shared]
        calls.clear()
        assert len(r.requests(GOOD, max_new_tokens=3)) == 2 and len(calls) == 1
        calls.clear()
        own = [SamplingParams(max_new_tokens=3), SamplingParams(top_p=0.0), SamplingParams(top_k=-1)]
        ins = r.requests([GOOD[0], GOOD[1], []], sampling=own)
        assert calls == own
        assert ins[0].error is None and "top_p must be in (0, 1]" in ins[1].error and "empty" in ins[2].error


class FailFor(Policy):
    """Misbehaves only for requests whose prompt starts with token 99."""

    def __init__(self, how):
        self.how = how

    def route(self, step):
        if step.request.prompt_ids[0] == 99 and step.position == 2:
            if self.how == "raise":
                raise ZeroDivisionError("boom in my router")
            return "medium"
        return "large" if step.position % 2 else "small"


@pytest.mark.parametrize("concurrency", [1, 4])
def test_route_returns_unknown_model(pair, tok, concurrency):
    with Router(pair, FailFor("unknown"), tokenizer=tok) as r:
        outs = r.generate([GOOD[0], [99, 3, 4], GOOD[1]], max_new_tokens=6, ignore_eos=True, concurrency=concurrency)
        assert all(free == usable for free, usable in pools_free(r).values())
    err = outs[1].error
    assert outs[1].finish_reason == "failed"
    assert "FailFor" in err and "'medium'" in err and "['small', 'large']" in err and "position 2" in err
    assert len(outs[1].token_ids) == 2  # committed before the failure, kept in the output
    check_others_ok(outs, 1)


def test_route_raises(pair, tok):
    with Router(pair, FailFor("raise"), tokenizer=tok) as r:
        outs = r.generate([GOOD[0], [99, 3, 4], GOOD[1]], max_new_tokens=6, ignore_eos=True)
    err = outs[1].error
    assert outs[1].finish_reason == "failed"
    assert "FailFor" in err and "ZeroDivisionError" in err and "boom in my router" in err and "route" in err
    check_others_ok(outs, 1)


def test_send_raises_and_ping_pong(pair, tok):
    class BadSend(Policy):
        def route(self, step):
            return step.request.prompt_ids[0] == 99

        def send(self, req, target):
            raise KeyError("no handoff for you")

    class PingPong(Policy):
        def route(self, step):  # always hands off, always discards: never commits
            return step.request.prompt_ids[0] == 99

    for pol, words in (
        (BadSend(), ["BadSend", "send", "no handoff for you"]),
        (PingPong(), ["PingPong", "without committing", "keep_sampled=True"]),
    ):
        with Router(pair, pol, tokenizer=tok) as r:
            outs = r.generate([GOOD[0], [99, 3], GOOD[1]], max_new_tokens=6, ignore_eos=True)
            assert r.engine.wait_idle()
        assert outs[1].finish_reason == "failed" and all(w in outs[1].error for w in words), outs[1].error
        check_others_ok(outs, 1)


def test_kv_pool_too_small_for_one_request(pair, tok):
    with Router(pair, RandomRouting(0.3), tokenizer=tok, max_kv_tokens=32, block_size=8) as r:
        outs = r.generate([GOOD[0], list(range(3, 60)), GOOD[1]], max_new_tokens=6, ignore_eos=True)
    assert outs[1].finish_reason == "failed"
    assert "too small" in outs[1].error and "max_kv_tokens" in outs[1].error
    check_others_ok(outs, 1)


def test_tokenizer_mismatch_at_construction(pair, tok):
    vocab = {chr(97 + i): i for i in range(26)} | {"<unk>": 26}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")
    m = tiny_model(num_layers=1, seed=3)
    with pytest.raises(TokenizerMismatchError) as ei:
        Router({"small": (m, other), "large": (pair["large"], tok)})
    assert "'small'" in str(ei.value) and "'large'" in str(ei.value)


def test_bad_sampling_values(pair, tok):
    with Router(pair, tokenizer=tok) as r:
        for kw, word in (({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k")):
            with pytest.raises(ValueError, match=word):
                r.generate(GOOD, max_new_tokens=3, **kw)


def test_closed_router_refuses(pair, tok):
    r = Router(pair, tokenizer=tok)
    r.close()
    r.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        r.generate(GOOD, max_new_tokens=3)
