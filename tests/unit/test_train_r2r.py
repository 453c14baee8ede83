"""R2R training pipeline end to end on tiny models: the verifier rule on hand cases, labels
against an independent recomputation (HF greedy generation and forwards), training, threshold
recall on validation, files and meta, and the trained head routing in the engine like the
naive reference."""

import json

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams, StepBatch
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate
from tokenrouter_sdk.policies.heads import load_head
from tokenrouter_sdk.policies.r2r import R2R
from tokenrouter_sdk.reference import reference_generate
from tokenrouter_sdk.request import RequestView
from tokenrouter_sdk.train.common import Pair
from tokenrouter_sdk.train.data import Example
from tokenrouter_sdk.train.r2r import first_sentence, label_r2r, rule_verifier, train_r2r

PROMPTS = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(8)]


@pytest.fixture(scope="module")
def pair():
    large = tiny_model(num_layers=2, seed=0)
    return truncate(large, 1), large, tiny_tokenizer()


def test_rule_verifier_hand_cases():
    assert rule_verifier("", " The total is 5.", " The total is 6.")  # numbers differ
    assert not rule_verifier("", " So the answer is 7.", " So the answer is 7.")  # identical
    assert not rule_verifier("", " So we add 3 apples.", " Thus we add 3 apples.")  # re-converged
    assert rule_verifier("", " We add 3 and 4.", " We add 3 and 4 apples.")  # words differ at the end
    assert not rule_verifier("", " 1,200 eggs.", " 1200 eggs.")  # separators normalised
    assert first_sentence(" He has 3.5 eggs. Then") == " He has 3.5 eggs."
    assert first_sentence("\nNext line\nmore") == "\nNext line\n"
    assert first_sentence("no end") == "no end"


def _greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=258, eos_token_id=None)
    return out[0, len(ids) :].tolist()


def test_labels_match_independent_computation(pair):
    small, large, tok = pair
    calls = []

    def verifier(context, a, b):
        calls.append((a, b))
        return len(a) % 2 == 0

    exs = [Example(f"p{i}", p) for i, p in enumerate(PROMPTS[:3])]
    with Pair({"small": small, "large": large}, tok) as pr:
        d = label_r2r(pr, exs, max_new_tokens=12, branch_tokens=6, max_branches=3, verifier=verifier)
        prompts = [pr.encode(e.prompt) for e in exs]
    assert len(calls) == len(d.branches) == int((d.kind > 0).sum()) > 0
    for i, p in enumerate(prompts):
        resp = d.responses[i]
        assert resp[: len(resp)] == _greedy(large, p, 12)[: len(resp)]  # L's greedy response
        with torch.no_grad():
            s_pred = small(torch.tensor([p + resp])).logits[0, len(p) - 1 : -1].argmax(-1).tolist()
        rows = (d.example == i).nonzero()[:, 0].tolist()
        for r in rows:
            t = int(d.position[r])
            assert int(d.token[r]) == s_pred[t]
            if s_pred[t] == resp[t]:
                assert int(d.kind[r]) == 0 and d.label[r] == 0
            else:
                assert int(d.kind[r]) in (1, 2)
        # every identical position is a row; differing ones at most max_branches
        ident = [t for t in range(len(resp)) if s_pred[t] == resp[t]]
        assert sorted(int(d.position[r]) for r in rows if d.kind[r] == 0) == ident
        assert sum(1 for r in rows if d.kind[r] > 0) == min(3, len(resp) - len(ident))
    for b in d.branches:
        i = int(b["example"][1:])
        p, resp, t = prompts[i], d.responses[i], b["t"]
        cont = _greedy(large, p + resp[:t] + [b["small_token"]], 6)
        text = tok.decode([b["small_token"]] + cont, skip_special_tokens=True)
        assert b["small_branch"] == first_sentence(text)
        assert b["large_branch"] == first_sentence(tok.decode(resp[t : t + 7], skip_special_tokens=True))
        assert b["divergent"] == (len(b["small_branch"]) % 2 == 0)
    assert d.label.sum() == (d.kind == 2).sum()


def test_train_r2r_end_to_end(pair, tmp_path):
    small, large, tok = pair
    res = train_r2r(
        {"small": small, "large": large},
        PROMPTS,
        tokenizer=tok,
        out=tmp_path,
        max_new_tokens=16,
        branch_tokens=8,
        max_branches=4,
        hidden_dims=(32, 32),
        epochs=30,
        progress=False,
    )
    # files and meta
    assert res.head_path == tmp_path / "r2r_head.pt" and res.meta_path.exists()
    sd, cfg, meta = load_head(res.head_path, "r2r")
    assert cfg["threshold"] == pytest.approx(res.threshold)
    js = json.loads(res.meta_path.read_text())
    assert js == meta
    assert sorted(js["data"]["train_ids"] + js["data"]["val_ids"]) == [f"prompt-{i:04d}" for i in range(8)]
    assert js["models"]["small"]["num_hidden_layers"] == 1 and js["models"]["large"]["num_hidden_layers"] == 2
    assert js["hyperparameters"]["max_branches"] == 4 and js["metrics"]["labels"]["rows"] > 0
    # training lowered the loss
    h = res.history
    assert min(h["train_loss"]) < h["initial_train_loss"]
    # the threshold reaches the target recall on validation, through the policy's own scoring
    tr, va = res.data
    pol = R2R(res.head_path, embedding=small)
    assert pol.tau == pytest.approx(res.threshold)
    logits = torch.full((len(va.label), len(tok)), -1e4)
    logits[:, : va.topk.shape[1]] = va.topk
    views = [
        RequestView(rid=i, prompt_ids=[1], output_ids=[], owner="small", state={}, hops=0, models=("small", "large"))
        for i in range(len(va.label))
    ]
    batch = StepBatch("small", ("small", "large"), va.token, logits, va.hidden.double(), views)
    routed = pol.defer(batch)
    assert va.label.sum() > 0
    assert float(routed[va.label.bool()].float().mean()) >= 0.95
    assert res.metrics["val"]["recall"] >= 0.95
    # the trained head routes in the engine exactly like the naive reference
    pol = res.policy(tau=res.metrics["tau_at_large_fraction_0.2"])
    params = SamplingParams(max_new_tokens=12)
    with Router({"small": small, "large": large}, pol, tokenizer=tok) as router:
        outs = router.generate(PROMPTS[:3], max_new_tokens=12)
        ids = [router.encode(p) for p in PROMPTS[:3]]
    for o, p in zip(outs, ids):
        ref = reference_generate(
            {"small": small, "large": large}, p, pol, params, rid=o.rid, tokenizer=tok, eos_ids=(tok.eos_token_id,)
        )
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"])
    assert any("large" in o.token_models for o in outs)


def test_cli_train_subcommand_parses():
    from tokenrouter_sdk.cli.main import build_parser
    from tokenrouter_sdk.cli.train import run

    a = build_parser().parse_args(["train", "co_llm", "--limit", "5", "--out", "x", "--epochs", "3"])
    assert (a.kind, a.limit, a.out, a.epochs, a.fn) == ("co_llm", 5, "x", 3, run)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "nope"])


def test_load_examples_excludes_heldout(tmp_path):
    from tokenrouter_sdk.train.data import HELDOUT_IDS, gold_response, load_examples

    rows = [
        {
            "id": f"gsm8k-test-{i:04d}",
            "question": f"q{i}",
            "answer": str(i),
            "meta": {"solution": f"2 + {i} = <<2+{i}={i + 2}>>{i + 2}\n#### {i}"},
        }
        for i in range(126, 132)
    ]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    exs = load_examples(f)
    assert [e.id for e in exs] == ["gsm8k-test-0128", "gsm8k-test-0129", "gsm8k-test-0130", "gsm8k-test-0131"]
    assert not HELDOUT_IDS & {e.id for e in exs}
    assert exs[0].solution == "2 + 128 = 130\nThe answer is 128." == gold_response(rows[2]["meta"]["solution"], "128")
    assert [e.id for e in load_examples(f, limit=2, exclude_heldout=False)] == ["gsm8k-test-0126", "gsm8k-test-0127"]
