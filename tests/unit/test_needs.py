"""Per-step data on demand: what a step computes from its own logits (logits, log-probabilities,
entropy, max probability, top-k) is there for every policy, computed when read, once per step and
never when no policy reads it; what must be kept or travel (hidden states, a handoff's logits,
prompt hidden states) is there when `Needs` declares it, and reading it otherwise fails the
request with an error naming the flag to set."""

import pytest
import torch

from tokenrouter_sdk import Handoff, Needs, Policy, Router, StepBatch
from tokenrouter_sdk.policy import NeedsError
from tokenrouter_sdk.request import RequestView

from ..helpers import mixed_prompts


def batch(needs, b=3, v=11, h=5, rows=None):
    g = torch.Generator().manual_seed(0)
    logits, hidden = torch.randn(b, v, generator=g), torch.randn(b, h, generator=g)
    reqs = [
        RequestView(rid=i, prompt_ids=[1], output_ids=[], owner="small", state={}, hops=0, models=("small", "large"))
        for i in range(b)
    ]
    n = b if rows is None else len(rows)
    return StepBatch(
        "small",
        ["small", "large"],
        torch.zeros(n, dtype=torch.long),
        logits,
        hidden,
        reqs[:n],
        needs=needs,
        rows=None if rows is None else torch.tensor(rows),
        policy="P()",
    ), logits


@pytest.mark.parametrize(
    "needs,read,flag",
    [
        (Needs(), lambda b: b.hidden, "hidden=True"),
        (Needs(entropy=True, logits=True, topk=5), lambda b: b[1].hidden, "hidden=True"),
        (Needs(), lambda b: b.peer_logits, "handoff_logits=True"),
        (Needs(hidden=True), lambda b: b[0].prompt_hidden, "prompt_hidden=True"),
    ],
)
def test_undeclared_reads_of_what_is_kept_name_the_flag(needs, read, flag):
    b, _ = batch(needs)
    with pytest.raises(NeedsError, match=rf"P\(\) reads .* Needs\({flag}\)"):
        read(b)


def test_the_steps_own_numbers_need_no_declaration(monkeypatch):
    """Logits, log-probabilities, entropy, max probability and top-k of the step's own logits
    are there with ``Needs()``: each equal to its definition, the log-softmax computed once for
    all of them, top-k once for the largest k read so far."""
    b, logits = batch(Needs())
    calls = {"log_softmax": 0, "topk": []}
    real_ls, real_topk = torch.log_softmax, torch.topk
    monkeypatch.setattr(
        torch,
        "log_softmax",
        lambda *a, **k: calls.__setitem__("log_softmax", calls["log_softmax"] + 1) or real_ls(*a, **k),
    )
    monkeypatch.setattr(torch, "topk", lambda *a, **k: calls["topk"].append(a[1]) or real_topk(*a, **k))
    lp = logits.log_softmax(-1)
    assert torch.equal(b.logits, logits) and torch.allclose(b.logprobs, lp)
    assert torch.allclose(b.entropy, -(lp.exp() * lp).sum(-1))
    assert torch.allclose(b.norm_entropy, b.entropy / torch.log(torch.tensor(11.0)))
    assert torch.allclose(b.max_prob, lp.exp().max(-1).values)
    assert b[2].max_prob == pytest.approx(float(lp[2].exp().max())) and b[0].entropy == pytest.approx(
        float(b.entropy[0])
    )
    assert calls["log_softmax"] == 1  # once for every one of them
    assert torch.equal(b.topk(2).indices, real_topk(logits, 2).indices)
    assert torch.allclose(b.topk(2).probs, lp.exp().topk(2).values)  # log-sum-exp from the log-softmax read
    assert torch.equal(b[1].topk(5).indices, real_topk(logits[1], 5).indices)
    b.topk(3), b[0].topk(1)
    assert calls["topk"] == [2, 5]  # a larger k reads again; a smaller one shares it
    assert b.topk(50).indices.shape == (3, 11)  # at most V
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        b.topk(0)


def test_declared_reads_compute_once_and_copy_nothing(monkeypatch):
    b, logits = batch(Needs(topk=4, hidden=True))
    calls = []
    real = torch.topk
    monkeypatch.setattr(torch, "topk", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    v2, i2 = b.topk(2)
    v4, i4 = b[2].topk(4)
    assert calls == [4]  # one top-k, to the declared k, shared by every read
    assert torch.equal(v2, real(logits, 2).values) and torch.equal(v4, real(logits[2], 4).values)
    full, _ = batch(Needs(logits=True))
    assert full.logits.data_ptr() == full._logits_all.data_ptr()  # all rows: no copy
    sub, logits = batch(Needs(logits=True, entropy=True), rows=[2, 0])
    assert torch.equal(sub.logits, logits[[2, 0]])
    assert torch.allclose(sub.entropy, -(logits[[2, 0]].log_softmax(-1).exp() * logits[[2, 0]].log_softmax(-1)).sum(-1))
    assert torch.equal(sub.select([1]).logits, logits[[0]])


class ReadsSignals(Policy):
    """Declares nothing; routes on max probability, entropy and the top-2 margin."""

    def route(self, step):
        margin = float(step.topk(2).probs[0] - step.topk(2).probs[1])
        uncertain = step.max_prob < 0.2 or step.entropy > 4.0 or margin < 0.02
        other = [m for m in step.models if m != step.model][0]
        return other if uncertain and step.position % 3 == 1 else step.model

    def send(self, req, target):
        return Handoff(keep_sampled=True)


class ReadsHidden(Policy):
    def route(self, step):
        return "large" if float(step.hidden.norm()) > 1e9 else step.model


def test_a_policy_reading_the_steps_signals_undeclared_runs_as_the_reference(pair, tok):
    from tokenrouter_sdk import SamplingParams
    from tokenrouter_sdk.reference import reference_generate

    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with Router(pair, ReadsSignals(), tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(4), sampling=params)
    assert all(o.ok for o in outs), [o.error for o in outs]
    for o in outs:
        ref = reference_generate(pair, o.prompt, ReadsSignals(), params, rid=o.rid)
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"])
    assert sum(o.hops for o in outs) > 0


def test_a_policy_reading_undeclared_hidden_states_fails_its_requests_with_the_fix(pair, tok):
    with Router(pair, ReadsHidden(), tokenizer=tok) as r:
        with pytest.warns(RuntimeWarning, match="requests failed"):
            outs = r.generate(mixed_prompts(2), max_new_tokens=4, ignore_eos=True)
        assert all(o.finish_reason == "failed" for o in outs)
        assert "Needs(hidden=True)" in outs[0].error and "test_needs.py" in outs[0].error
        ReadsHidden.needs = Needs(hidden=True)
        try:
            outs = r.generate(mixed_prompts(2), max_new_tokens=4, ignore_eos=True)
        finally:
            ReadsHidden.needs = Needs()
        assert all(o.ok for o in outs)


class Reads(Policy):
    def __init__(self, read: bool):
        self.read = read

    def route(self, step):
        if self.read:
            step.max_prob, step.entropy  # noqa: B018 - read, not used
        return step.model


def test_a_step_whose_policy_reads_nothing_computes_nothing(pair, tok, monkeypatch):
    """The cost stays off steps whose policy never reads the signals: no log-softmax at all;
    a policy that reads them costs one per policy batch of a step, not one per request."""
    from tokenrouter_sdk.engine.messages import StepDone
    from tokenrouter_sdk.policy import StepBatch

    count = []
    real = StepBatch._log_softmax

    def counted(self):
        if self._logp is None:
            count.append(len(self))
        return real(self)

    monkeypatch.setattr(StepBatch, "_log_softmax", counted)
    with Router(pair, Reads(False), tokenizer=tok, processes=False) as r:
        r.generate(mixed_prompts(4), max_new_tokens=6, ignore_eos=True)
        assert count == []
        outs = r.generate(mixed_prompts(4), policy=Reads(True), max_new_tokens=6, ignore_eos=True)
    steps = [e for e in outs.trace if isinstance(e, StepDone)]
    assert len(count) == len(steps) and sum(count) == sum(e.batch_size for e in steps) == 24


def test_topk_gives_probabilities_beside_the_logits():
    """`Step.topk` unpacks as (logits, indices) and gives the probabilities under the softmax of
    all V logits (what max_prob is the first of)."""
    b, logits = batch(Needs(topk=3))
    t = b[1].topk(3)
    values, indices = t
    full = logits[1].double().softmax(-1)
    assert torch.equal(indices, full.topk(3).indices) and torch.equal(values, logits[1].topk(3).values)
    assert torch.allclose(t.probs.double(), full.topk(3).values, atol=1e-6)
    assert torch.allclose(t.logprobs.exp(), t.probs) and t.logits is values and t.indices is indices
    bt = b.topk(2)
    assert bt.probs.shape == (len(b), 2) and torch.allclose(bt.probs[1], t.probs[:2])
    assert b[1].max_prob == pytest.approx(float(t.probs[0]))
