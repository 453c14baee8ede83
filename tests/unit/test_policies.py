"""Routing semantics of the built-in policies."""

import math

import pytest
import torch

from tokenrouter_sdk import Router, StepBatch
from tokenrouter_sdk.policies import LargeOnly, RandomRouting, RStitch, SingleModel, SmallOnly
from tokenrouter_sdk.request import RequestView

from ..helpers import mixed_prompts

MODELS = ["small", "large"]


def step_with(model, probs):
    p = torch.tensor(probs, dtype=torch.float64)
    view = RequestView(rid=0, prompt_ids=[1], output_ids=[], owner=model, state={}, hops=0, models=tuple(MODELS))
    return StepBatch(model, MODELS, torch.tensor([0]), p.log()[None], torch.zeros(1, 4), [view])[0]


def test_step_signals():
    s = step_with("small", [0.5, 0.25, 0.25, 0.0])
    assert s.entropy == pytest.approx(1.5 * math.log(2))
    assert s.norm_entropy == pytest.approx(1.5 * math.log(2) / math.log(4))
    assert s.max_prob == pytest.approx(0.5)
    assert s.topk(2)[1].tolist() == [0, 1]


def test_rstitch_directions_and_commit_rule():
    pol = RStitch(tau=0.5)
    peaked, flat = [0.97, 0.01, 0.01, 0.01], [0.25] * 4
    assert pol.route(step_with("small", peaked)) == "small"
    assert pol.route(step_with("small", flat)) == "large"
    assert pol.route(step_with("large", flat)) == "large"  # large stays while uncertain
    assert pol.route(step_with("large", peaked)) == "small"  # and hands back when confident

    def view(owner):
        return RequestView(rid=0, prompt_ids=[1], output_ids=[], owner=owner, state={}, hops=0, models=tuple(MODELS))

    assert pol.send(view("small"), "large").keep_sampled is False  # small token discarded
    assert pol.send(view("large"), "small").keep_sampled is True  # large token kept
    mp = RStitch(tau=0.6, signal="max_prob", tau_back=0.9)
    assert mp.route(step_with("small", [0.5, 0.3, 0.1, 0.1])) == "large"
    assert mp.route(step_with("large", [0.8, 0.1, 0.05, 0.05])) == "large"
    assert mp.route(step_with("large", [0.95, 0.03, 0.01, 0.01])) == "small"
    with pytest.raises(ValueError, match="signal"):
        RStitch(signal="bogus")


def test_random_routing_peer_writes_one_token(pair, tok):
    with Router(pair, RandomRouting(p=0.4, seed=9), tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(6, seed=2), max_new_tokens=30, ignore_eos=True)
    for o in outs:  # every visit to the large model writes exactly one token, then control returns
        assert o.discarded == o.token_models.count("large") > 0  # one discard per large token
        assert o.hops == 2 * o.discarded - (o.token_models[-1] == "large")
    frac = sum(o.token_models.count("large") for o in outs) / sum(len(o.token_models) for o in outs)
    assert 0.15 < frac < 0.45  # p = 0.4 per small step -> about p / (1 + p) = 0.29 of tokens
    with pytest.raises(ValueError, match="p must be in"):
        RandomRouting(p=1.5)


def test_single_model_policies_enter_and_stay(pair, tok):
    with Router(pair, tokenizer=tok) as r:
        for pol, who in ((SmallOnly(), "small"), (LargeOnly(), "large"), (SingleModel("large"), "large")):
            outs = r.generate(mixed_prompts(3), max_new_tokens=5, ignore_eos=True, policy=pol)
            assert all(o.token_models == [who] * 5 and o.hops == 0 for o in outs)
            m = r.metrics()
            other = "large" if who == "small" else "small"
            assert m.per_model[other].steps == 0  # never prefilled on the other model
        bad = r.generate(mixed_prompts(1), max_new_tokens=5, policy=SingleModel("huge"))
        assert bad[0].finish_reason == "failed" and "huge" in bad[0].error
