"""Co-LLM deferral head training on tiny models: teacher-forced features against an independent
forward, the marginal-likelihood objective, weak-supervision init, Youden's J threshold by brute
force, files, and the head loading into CoLLM and routing in the engine."""

import json
import math

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate
from tokenrouter_sdk.policies.co_llm import CoLLM
from tokenrouter_sdk.policies.heads import load_head
from tokenrouter_sdk.train.co_llm import features_co_llm, marginal_nll, train_co_llm
from tokenrouter_sdk.train.common import Pair
from tokenrouter_sdk.train.data import Example

EXS = [
    Example(
        f"q{i}",
        f"Question {i}: add {i} and {i + 2}.",
        str(2 * i + 2),
        f"We add {i} and {i + 2} to get {2 * i + 2}.\nThe answer is {2 * i + 2}.",
    )
    for i in range(8)
]


@pytest.fixture(scope="module")
def pair():
    large = tiny_model(num_layers=2, seed=2)
    return truncate(large, 1), large, tiny_tokenizer()


def test_marginal_nll_formula():
    z, ls, ll = torch.tensor([0.3, -2.0]), torch.log(torch.tensor([0.1, 0.5])), torch.log(torch.tensor([0.7, 0.2]))
    pi = torch.sigmoid(z)
    want = -torch.log((1 - pi) * ls.exp() + pi * ll.exp())
    assert torch.allclose(marginal_nll(z, ls, ll), want, atol=1e-6)


def test_features_match_independent_forward(pair):
    small, large, tok = pair
    with Pair({"small": small, "large": large}, tok) as pr:
        f = features_co_llm(pr, EXS[:2])
        p = pr.encode(EXS[1].prompt)
    g = tok.encode(EXS[1].solution, add_special_tokens=False)
    with torch.no_grad():
        ls = torch.log_softmax(small(torch.tensor([p + g])).logits[0, len(p) - 1 : -1].float(), -1)
        ll = torch.log_softmax(large(torch.tensor([p + g])).logits[0, len(p) - 1 : -1].float(), -1)
    m = f["example"] == 1
    gt = torch.tensor(g)
    assert torch.allclose(f["lp_small"][m], ls.gather(1, gt[:, None])[:, 0], atol=1e-5)
    assert torch.allclose(f["lp_large"][m], ll.gather(1, gt[:, None])[:, 0], atol=1e-5)
    assert f["large_greedy"][m].tolist() == ll.argmax(-1).tolist()
    assert f["gold"][m].tolist() == g


def test_train_co_llm_end_to_end(pair, tmp_path):
    small, large, tok = pair
    res = train_co_llm(
        {"small": small, "large": large},
        EXS,
        tokenizer=tok,
        out=tmp_path,
        init_epochs=10,
        epochs=60,
        lr=3e-2,
        batch_size=64,
        progress=False,
    )
    sd, cfg, meta = load_head(res.head_path, "co_llm")
    assert set(sd) == {"g", "b"} and json.loads(res.meta_path.read_text()) == meta
    for stage in ("init", "marginal"):
        assert min(res.history[stage]["train_loss"]) < res.history[stage]["initial_train_loss"]
    T, V = res.data
    # the marginal objective beats the untrained head (pi = 0.5) on the training rows
    with torch.no_grad():
        z = T["hidden"] @ sd["g"] + sd["b"]
    half = marginal_nll(torch.zeros(len(z)), T["lp_small"], T["lp_large"]).mean()
    assert marginal_nll(z, T["lp_small"], T["lp_large"]).mean() < half
    # eta maximises Youden's J on validation (brute force over all cut points)
    pol = CoLLM(res.head_path, eta=res.threshold)
    pi = pol._net(V["hidden"])
    y = V["large_greedy"] != V["small_greedy"]

    def j(eta):
        pred = pi > eta
        return (pred & y).sum() / max(1, y.sum()) - (pred & ~y).sum() / max(1, (~y).sum())

    best = max(float(j(e)) for e in [-math.inf] + pi.tolist())
    assert float(j(res.threshold)) == pytest.approx(best, abs=1e-6)
    with Router({"small": small, "large": large}, res.policy(eta=float(pi.median())), tokenizer=tok) as router:
        outs = router.generate([e.prompt for e in EXS[:3]], max_new_tokens=10)
    assert all(o.ok for o in outs)
