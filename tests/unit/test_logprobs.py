"""Log-probabilities, teacher-forced scoring and ``n`` samples per prompt: each committed token's
log-probability (and top alternatives) under the model that wrote it equals the naive
reference's, recomputed from scratch; `Router.score` routes a given continuation as the policy
routes generation (checked against the reference with the same forced tokens); ``n=3`` gives
three samples with their own keys."""

import pytest

from tests.helpers import DiscardTwoBack, mixed_prompts
from tokenrouter_sdk import Handoff, Policy, Resample, Router, SamplingParams
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate, reference_logprobs


class SpanTwo(Policy):
    """small hands off, discarding, when the token id is a multiple of 3; large writes two
    tokens and hands back (a forced span, as R2R's)."""

    def route(self, step):
        return "large" if step.model == "small" and step.token % 3 == 0 else step.model

    def send(self, req, target):
        return Handoff(keep_sampled=False, span=2)


class ResampleOdd(Policy):
    """Draws a position again while the token id is odd (at most twice), then stays."""

    def route(self, step):
        n = step.state.get("redo", 0)
        if step.token % 2 and n < 2:
            step.state["redo"] = n + 1
            return Resample()
        step.state["redo"] = 0
        return step.model


class ByPosition(Policy):
    """small hands off, discarding, at positions 1, 5, 9, ...; large hands back on its next step:
    routing that depends on positions only, so scoring an output routes as generating it did."""

    def route(self, step):
        if step.model == "small":
            return "large" if step.position % 4 == 1 else "small"
        return "small"

    def send(self, req, target):
        return Handoff(keep_sampled=(req.owner == "large"))


POLICIES = {"random": lambda: RandomRouting(p=0.4, seed=5), "discard": DiscardTwoBack, "span": SpanTwo}


@pytest.mark.parametrize("name", list(POLICIES))
def test_logprobs_equal_the_reference_under_each_writer(pair, tok, name):
    params = SamplingParams(max_new_tokens=14, ignore_eos=True, logprobs=3)
    prompts = mixed_prompts(4, seed=2)
    with Router(pair, POLICIES[name](), tokenizer=tok) as r:
        outs = r.generate(prompts, sampling=params)
    assert {m for o in outs for m in o.token_models} == {"small", "large"}  # both write
    for o in outs:
        ref = reference_generate(pair, o.prompt, POLICIES[name](), params, rid=o.rid, key=o.key)
        assert o.token_ids == ref["token_ids"] and o.token_models == ref["token_models"]
        assert o.logprobs == pytest.approx(ref["logprobs"], abs=1e-9)
        scratch = reference_logprobs(pair, o.prompt, o.token_ids, o.token_models, top=3)
        assert o.logprobs == pytest.approx([lp for lp, _ in scratch], abs=1e-9)
        for got, (_, alts) in zip(o.top_logprobs, scratch):
            assert list(got) == [t for t, _ in alts] and list(got.values()) == pytest.approx(
                [v for _, v in alts], abs=1e-9
            )
        assert all(lp <= 0 for lp in o.logprobs) and len(o.logprobs) == len(o.token_ids)


def test_logprobs_are_off_by_default_and_zero_keeps_no_alternatives(pair, tok):
    with Router(pair, RandomRouting(p=0.3, seed=1), tokenizer=tok) as r:
        off = r.generate([[5, 6, 7]], max_new_tokens=4, ignore_eos=True)[0]
        zero = r.generate([[5, 6, 7]], max_new_tokens=4, ignore_eos=True, logprobs=0)[0]
    assert off.logprobs is None and off.top_logprobs is None
    assert len(zero.logprobs) == 4 and zero.top_logprobs is None
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1).validate()


@pytest.mark.parametrize("name", ["random", "discard", "span", "resample"])
def test_score_routes_the_given_tokens_as_the_reference(pair, tok, name):
    factory = {**POLICIES, "resample": ResampleOdd}[name]
    prompts = mixed_prompts(3, seed=5)
    conts = [[(7 * i + 3 * j) % 250 + 3 for j in range(9)] for i in range(3)]
    with Router(pair, factory(), tokenizer=tok) as r:
        outs = r.score(prompts, conts)
        text = r.score(["ab"], [" cd"])[0]
    for o, cont in zip(outs, conts):
        assert o.ok and o.token_ids == cont and o.finish_reason == "length"
        ref = reference_generate(
            pair,
            o.prompt,
            factory(),
            SamplingParams(max_new_tokens=len(cont), ignore_eos=True),
            rid=o.rid,
            key=o.key,
            forced=cont,
        )
        assert o.token_models == ref["token_models"] and o.hops == ref["hops"]
        assert o.logprobs == pytest.approx(ref["logprobs"], abs=1e-9)
        scratch = reference_logprobs(pair, o.prompt, cont, o.token_models, top=1)
        assert o.logprobs == pytest.approx([lp for lp, _ in scratch], abs=1e-9)
        assert [next(iter(t)) for t in o.top_logprobs] == [alts[0][0] for _, alts in scratch]
    if name != "resample":
        assert {m for o in outs for m in o.token_models} == {"small", "large"}
    assert tok.decode(text.token_ids) == " cd" and len(text.logprobs) == 3


def test_score_bad_input_fails_that_request_alone(pair, tok):
    with Router(pair, tokenizer=tok) as r, pytest.warns(RuntimeWarning, match="failed"):
        outs = r.score([[5, 6], [5, 6], [5, 6]], [[7, 8], [], [9999]])
        with pytest.raises(ValueError, match="continuations"):
            r.score([[5]], [])
    assert outs[0].ok and "empty" in outs[1].error and "vocabulary" in outs[2].error


def test_n_samples_with_their_own_keys(pair, tok):
    with Router(pair, RandomRouting(p=0.4, seed=5), tokenizer=tok) as r:
        outs = r.generate([[5, 6, 7], [8, 9]], n=3, max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=4)
        one = r.generate([5, 6, 7], n=3, max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=4)
        keyed = r.generate([[5, 6, 7]], n=2, keys=["q"], max_new_tokens=4, ignore_eos=True)
        again = r.generate([[5, 6, 7]], keys=[outs[1].key], max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=5)[
            0
        ]
    assert len(outs) == 6 and [o.sample for o in outs] == [0, 1, 2, 0, 1, 2]
    assert [o.prompt for o in outs] == [[5, 6, 7]] * 3 + [[8, 9]] * 3
    assert len({o.key for o in outs}) == 6 and all(o.ok and len(o.token_ids) == 8 for o in outs)
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3  # seeds 4, 5, 6: three different samples
    assert [o.token_ids for o in one] == [o.token_ids for o in outs[:3]] and len(one) == 3
    assert again.token_ids == outs[1].token_ids  # sample 1: its own key, and seed + 1
    assert [o.key for o in keyed] == ["q", "q#1"]
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0).validate()


def test_logprobs_and_score_through_processes(pair, tok):
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=2)
    with Router(pair, ByPosition(), tokenizer=tok, processes=True) as r:
        out = r.generate([[11, 12, 13]], sampling=params)[0]
        scored = r.score([[11, 12, 13]], [out.token_ids])[0]
    scratch = reference_logprobs(pair, [11, 12, 13], out.token_ids, out.token_models, top=2)
    assert out.logprobs == pytest.approx([lp for lp, _ in scratch], abs=1e-9)
    assert scored.token_models == out.token_models  # greedy: scoring its own output routes the same
    assert scored.logprobs == pytest.approx(out.logprobs, abs=1e-9)
