"""CITER training pipeline on tiny models: labels against a hand construction (gold text built
so that the small model, the large model or neither predicts each character), rollouts
recomputed with HF greedy generation, training, threshold recall, files, routing in the engine."""

import json

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate
from tokenrouter_sdk.policies.citer import CITER
from tokenrouter_sdk.policies.heads import load_head
from tokenrouter_sdk.train.citer import label_citer, train_citer
from tokenrouter_sdk.train.common import Pair
from tokenrouter_sdk.train.data import Example

PRINTABLE = range(33, 127)


def _check(text, ex):
    return len(text) % 2 == 0


@pytest.fixture(scope="module")
def setup():
    large = tiny_model(num_layers=2, seed=1)
    small, tok = truncate(large, 1), tiny_tokenizer()
    exs, plan = [], []
    with Pair({"small": small, "large": large}, tok) as pr:
        for i in range(6):
            ex = Example(f"q{i}", f"Question {i}: add {i} and {i + 2}.", str(2 * i + 2))
            p, gold, kinds = pr.encode(ex.prompt), [], []
            for t in range(15):
                with torch.no_grad():
                    s = int(small(torch.tensor([p + gold])).logits[0, -1].argmax())
                    lg = int(large(torch.tensor([p + gold])).logits[0, -1].argmax())
                want = t % 3
                if want == 0 and s in PRINTABLE:
                    c, k = s, 0
                elif want == 1 and lg in PRINTABLE and lg != s:
                    c, k = lg, 1
                else:
                    c = next(x for x in PRINTABLE if x not in (s, lg))
                    k = 2
                gold.append(c)
                kinds.append(k)
            ex.solution = bytes(gold).decode()
            exs.append(ex)
            plan.append(kinds)
    return small, large, tok, exs, plan


def test_labels_match_hand_construction(setup):
    small, large, tok, exs, plan = setup
    with Pair({"small": small, "large": large}, tok) as pr:
        d = label_citer(pr, exs, rollout_tokens=5, max_rollouts=2, check=_check)
        prompts = [pr.encode(e.prompt) for e in exs]
    c = d.counts()
    assert c["small_right"] > 0 and c["large_right"] > 0 and c["rollout"] > 0
    for r in range(len(d.label)):
        i, t = int(d.example[r]), int(d.position[r])
        assert int(d.reason[r]) == plan[i][t]
        if plan[i][t] == 0:
            assert d.label[r] == 1
        elif plan[i][t] == 1:
            assert d.label[r] == 0
    # at most max_rollouts per example; the rest of the both-wrong positions are left out
    for i, kinds in enumerate(plan):
        n = int(((d.example == i) & (d.reason == 2)).sum())
        assert n == min(2, kinds.count(2))
    # each rollout: small greedy continuation of gold[:t] + small token, label = check(text)
    assert len(d.rollouts) == c["rollout"]
    for ro in d.rollouts:
        i = int(ro["example"][1:])
        g = list(exs[i].solution.encode())
        t = ro["t"]
        with torch.no_grad():
            s_tok = int(small(torch.tensor([prompts[i] + g[:t]])).logits[0, -1].argmax())
            out = small.generate(
                torch.tensor([prompts[i] + g[:t] + [s_tok]]),
                max_new_tokens=5,
                do_sample=False,
                pad_token_id=258,
                eos_token_id=257,
            )
        cont = [x for x in out[0, len(prompts[i]) + t + 1 :].tolist()]
        if 257 in cont:
            cont = cont[: cont.index(257) + 1]
        text = tok.decode(g[:t] + [s_tok] + cont, skip_special_tokens=True)
        assert ro["text"] == text[-300:] and ro["correct"] == _check(text, exs[i])
        r = ((d.example == i) & (d.position == t)).nonzero()[0, 0]
        assert d.label[r] == float(ro["correct"])


def test_train_citer_end_to_end(setup, tmp_path):
    small, large, tok, exs, _ = setup
    res = train_citer(
        {"small": small, "large": large},
        exs,
        tokenizer=tok,
        out=tmp_path,
        rollout_tokens=5,
        max_rollouts=2,
        check=_check,
        epochs=40,
        progress=False,
    )
    sd, cfg, meta = load_head(res.head_path, "citer")
    assert json.loads(res.meta_path.read_text()) == meta and cfg["threshold"] == pytest.approx(res.threshold)
    assert meta["metrics"]["labels"]["rows"] == res.metrics["train_rows"] + res.metrics["val_rows"]
    assert min(res.history["train_loss"]) < res.history["initial_train_loss"]
    tr, va = res.data
    pol = CITER(res.head_path, tau=res.threshold)
    need = va.label == 0
    c = pol._net(va.hidden)
    assert float((c[need] < pol.tau).float().mean()) >= 0.95
    assert res.metrics["val"]["recall"] >= 0.95
    with Router(
        {"small": small, "large": large}, res.policy(tau=res.metrics["tau_at_large_fraction_0.2"]), tokenizer=tok
    ) as router:
        outs = router.generate([e.prompt for e in exs[:3]], max_new_tokens=10)
    assert all(o.ok for o in outs)
    assert any("large" in o.token_models for o in outs)
