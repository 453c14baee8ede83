"""Per-step data on demand: a step computes what the policy declared in `Needs`, and reading
anything else fails the request with an error naming the flag to set."""

import pytest
import torch

from tokenrouter_sdk import Needs, Policy, Router, StepBatch
from tokenrouter_sdk.policy import NeedsError
from tokenrouter_sdk.request import RequestView

from ..helpers import mixed_prompts


def batch(needs, b=3, v=11, h=5, rows=None):
    g = torch.Generator().manual_seed(0)
    logits, hidden = torch.randn(b, v, generator=g), torch.randn(b, h, generator=g)
    reqs = [RequestView(i, [1], [], "small", {}, 0, ("small", "large")) for i in range(b)]
    n = b if rows is None else len(rows)
    return StepBatch("small", ["small", "large"], torch.zeros(n, dtype=torch.long), logits, hidden,
                     reqs[:n], needs=needs, rows=None if rows is None else torch.tensor(rows), policy="P()"), logits


@pytest.mark.parametrize("needs,read,flag", [
    (Needs(), lambda b: b.logits, "logits=True"),
    (Needs(), lambda b: b.hidden, "hidden=True"),
    (Needs(), lambda b: b.entropy, "entropy=True"),
    (Needs(entropy=True), lambda b: b.logits, "logits=True"),
    (Needs(topk=4), lambda b: b.topk(5), "topk=5"),
    (Needs(hidden=True), lambda b: b[1].max_prob, "entropy=True"),
])
def test_undeclared_reads_name_the_flag(needs, read, flag):
    b, _ = batch(needs)
    with pytest.raises(NeedsError, match=rf"P\(\) reads .* Needs\({flag}\)"):
        read(b)


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


class ReadsEntropy(Policy):
    def route(self, step):
        return "large" if step.entropy > 1.0 else step.model


def test_a_policy_reading_undeclared_data_fails_its_requests_with_the_fix(pair, tok):
    with Router(pair, ReadsEntropy(), tokenizer=tok) as r:
        with pytest.warns(RuntimeWarning, match="requests failed"):
            outs = r.generate(mixed_prompts(2), max_new_tokens=4, ignore_eos=True)
        assert all(o.finish_reason == "failed" for o in outs)
        assert "Needs(entropy=True)" in outs[0].error and "test_needs.py" in outs[0].error
        ReadsEntropy.needs = Needs(entropy=True)
        try:
            outs = r.generate(mixed_prompts(2), max_new_tokens=4, ignore_eos=True)
        finally:
            ReadsEntropy.needs = Needs()
        assert all(o.ok for o in outs)


def test_topk_gives_probabilities_beside_the_logits():
    """`Step.topk` unpacks as (logits, indices) and gives the probabilities under the softmax of
    all V logits (what max_prob is the first of), with Needs(topk=k) only."""
    b, logits = batch(Needs(topk=3))
    t = b[1].topk(3)
    values, indices = t
    full = logits[1].double().softmax(-1)
    assert torch.equal(indices, full.topk(3).indices) and torch.equal(values, logits[1].topk(3).values)
    assert torch.allclose(t.probs.double(), full.topk(3).values, atol=1e-6)
    assert torch.allclose(t.logprobs.exp(), t.probs) and t.logits is values and t.indices is indices
    bt = b.topk(2)
    assert bt.probs.shape == (len(b), 2) and torch.allclose(bt.probs[1], t.probs[:2])
    with pytest.raises(NeedsError):
        b[1].max_prob  # noqa: B018 - topk alone does not open the entropy family
