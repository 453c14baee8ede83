"""Training on the large model's own answers: the shared (cached) greedy responses, R2R keeping
unverified differing positions as divergent, CITER and Co-LLM teacher-forcing the large model's
response (``reference="large"``), and the ``offset`` that keeps training questions apart from
evaluation ones. Labels are checked against an independent recomputation (HF greedy generation
and forwards) on tiny float64 models."""

import json

import pytest
import torch

from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate
from tokenrouter_sdk.train.citer import label_citer
from tokenrouter_sdk.train.co_llm import features_co_llm, train_co_llm
from tokenrouter_sdk.train.common import Pair, reference_responses
from tokenrouter_sdk.train.data import Example, load_examples
from tokenrouter_sdk.train.r2r import label_r2r

PROMPTS = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(6)]
EXS = [Example(f"p{i}", p, str(3 * i), f"We add to get {3 * i}.") for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def pair():
    large = tiny_model(num_layers=2, seed=3)
    return truncate(large, 1), large, tiny_tokenizer()


def _greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=258, eos_token_id=None)
    return out[0, len(ids) :].tolist()


def _small_preds(small, p, r):
    with torch.no_grad():
        return small(torch.tensor([p + r])).logits[0, len(p) - 1 : -1].argmax(-1).tolist()


def test_reference_responses_are_greedy_and_cached(pair, tmp_path):
    small, large, tok = pair
    with Pair({"small": small, "large": large}, tok) as pr:
        ids = [pr.encode(p) for p in PROMPTS[:3]]
        calls = []
        generate = pr.generate
        pr.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
        first = reference_responses(pr, ids, max_new_tokens=10, cache=tmp_path)
        again = reference_responses(pr, ids, max_new_tokens=10, cache=tmp_path)
        longer = reference_responses(pr, ids, max_new_tokens=12, cache=tmp_path)
    assert first == again and len(calls) == 2  # the second call read the cache
    assert len(list(tmp_path.glob("large_responses_*.json"))) == 2
    for p, r, r12 in zip(ids, first, longer):
        assert r == _greedy(large, p, 10)[: len(r)] and len(r) == 10
        assert r12[:10] == r


def test_r2r_unverified_differences_are_kept_as_divergent(pair):
    small, large, tok = pair
    exs = [Example(f"p{i}", p) for i, p in enumerate(PROMPTS[:3])]
    with Pair({"small": small, "large": large}, tok) as pr:
        d = label_r2r(
            pr,
            exs,
            max_new_tokens=12,
            branch_tokens=4,
            max_branches=1,
            unverified="divergent",
            verifier=lambda c, a, b: False,
        )
        drop = label_r2r(pr, exs, max_new_tokens=12, branch_tokens=4, max_branches=1, verifier=lambda c, a, b: False)
        prompts = [pr.encode(e.prompt) for e in exs]
        with pytest.raises(ValueError, match="unverified must be"):
            label_r2r(pr, exs, max_new_tokens=4, unverified="keep")
    differing = 0
    for i, p in enumerate(prompts):
        resp = d.responses[i]
        s_pred = _small_preds(small, p, resp)
        rows = (d.example == i).nonzero()[:, 0].tolist()
        assert [int(d.position[r]) for r in rows] == list(range(len(resp)))  # every position is a row
        for r in rows:
            t = int(d.position[r])
            same = s_pred[t] == resp[t]
            differing += not same
            assert (int(d.kind[r]) == 0) == same
            # verified ones are neutral here (the verifier says so), the others divergent
            assert float(d.label[r]) == float(int(d.kind[r]) == 3)
    c = d.counts()
    assert c["neutral"] == len(d.branches) <= 3 and c["unverified"] == differing - c["neutral"] > 0
    assert drop.counts()["unverified"] == 0 and len(drop.label) == len(d.label) - c["unverified"]


def test_citer_reference_large_teacher_forces_the_large_answer(pair, tmp_path):
    small, large, tok = pair
    with Pair({"small": small, "large": large}, tok) as pr:
        d = label_citer(
            pr, EXS[:3], reference="large", max_new_tokens=10, max_rollouts=2, rollout_tokens=4, cache=tmp_path
        )
        prompts = [pr.encode(e.prompt) for e in EXS[:3]]
        with pytest.raises(ValueError, match="reference must be"):
            label_citer(pr, EXS[:1], reference="silver")
    assert len(list(tmp_path.glob("large_responses_*.json"))) == 1
    for i, p in enumerate(prompts):
        ref = _greedy(large, p, 10)
        s_pred = _small_preds(small, p, ref)
        rows = (d.example == i).nonzero()[:, 0].tolist()
        assert [int(d.position[r]) for r in rows] == list(range(10))
        # along the large model's own greedy path it always predicts the reference token: no rollout
        assert d.label[rows].tolist() == [float(s == g) for s, g in zip(s_pred, ref)]
        assert set(d.reason[rows].tolist()) <= {0, 1}
    assert d.counts()["rollout"] == 0 and 0 < d.label.sum() < len(d.label)


def test_co_llm_reference_large_uses_the_large_answer(pair, tmp_path):
    small, large, tok = pair
    with Pair({"small": small, "large": large}, tok) as pr:
        f = features_co_llm(pr, EXS[:2], reference="large", max_new_tokens=8)
        p = pr.encode(EXS[1].prompt)
    ref = _greedy(large, p, 8)
    m = f["example"] == 1
    assert f["gold"][m].tolist() == ref
    assert f["large_greedy"][m].tolist() == ref  # the large model's argmax is its own answer
    res = train_co_llm(
        {"small": small, "large": large},
        EXS,
        tokenizer=tok,
        out=tmp_path,
        reference="large",
        max_new_tokens=8,
        epochs=5,
        init_epochs=2,
        progress=False,
    )
    js = json.loads(res.meta_path.read_text())
    assert js["hyperparameters"]["reference"] == "large" and js["hyperparameters"]["max_new_tokens"] == 8


def test_load_examples_offset_starts_at_that_row():
    exs = load_examples("gsm8k", 3, offset=556)
    assert [e.id for e in exs] == ["gsm8k-test-0556", "gsm8k-test-0557", "gsm8k-test-0558"]
    assert load_examples("gsm8k", 1, offset=0)[0].id == "gsm8k-test-0128"  # held-out ones still skipped
    assert [e.id for e in load_examples(None, 2, offset=556)] == ["gsm8k-train-0556", "gsm8k-train-0557"]
    with pytest.raises(ValueError, match="offset must be >= 0"):
        load_examples(None, 1, offset=-1)


def test_training_defaults_to_the_gsm8k_train_split(monkeypatch, tmp_path):
    """`load_examples`, the pipelines and ``tokenrouter train`` (training and calibration) read
    GSM8K train by default: no question of the test split, which evaluations score."""
    from tokenrouter_sdk import Router
    from tokenrouter_sdk import train as T
    from tokenrouter_sdk.cli import train as train_cli
    from tokenrouter_sdk.cli.main import build_parser
    from tokenrouter_sdk.train import package

    exs = load_examples(limit=3)
    assert [e.id for e in exs] == ["gsm8k-train-0000", "gsm8k-train-0001", "gsm8k-train-0002"]
    assert exs[0].answer == "72" and exs[0].solution.endswith("The answer is 72.")
    assert T.DEFAULT_DATA == "gsm8k_train"
    seen = {}

    class FakeRouter:
        models = {"small": object(), "large": object()}

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    def fake_train(router, **kw):
        seen["train"] = [e.id for e in load_examples(kw["data"], kw["limit"], offset=kw["offset"])]
        return type("Res", (), {"metrics": {}})()

    def fake_finalize(res, router, *, calib_prompts, **kw):
        seen["calibrate"] = [e.id for e in calib_prompts]
        return tmp_path / "h.pt", tmp_path / "h.json", 0.5

    monkeypatch.setattr(Router, "default", classmethod(lambda cls, **kw: FakeRouter()))
    monkeypatch.setattr(T, "train_query", fake_train, raising=False)
    monkeypatch.setattr(package, "finalize", fake_finalize)
    args = build_parser().parse_args(["train", "query", "--limit", "4", "--calibrate", "2", "--out", str(tmp_path)])
    assert args.data is None and train_cli.run(args) == 0
    assert seen["train"] == [f"gsm8k-train-{i:04d}" for i in range(4)]
    assert seen["calibrate"] == ["gsm8k-train-0000", "gsm8k-train-0001"]
    args = build_parser().parse_args(["train", "query", "--data", "gsm8k", "--limit", "2", "--out", str(tmp_path)])
    train_cli.run(args)
    assert seen["train"] == ["gsm8k-test-0128", "gsm8k-test-0129"]  # the test split only when asked for


def test_cli_options_reach_the_pipelines():
    from tokenrouter_sdk.cli.main import build_parser
    from tokenrouter_sdk.cli.train import pipeline_kwargs

    common = ["--offset", "556", "--limit", "300", "--cache", "c", "--concurrency", "64", "--max-new-tokens", "80"]
    kw = pipeline_kwargs(build_parser().parse_args(["train", "citer", *common, "--reference", "large"]))
    assert kw | {"out": None} == {
        "data": None,
        "limit": 300,
        "offset": 556,
        "out": None,
        "seed": 0,
        "max_new_tokens": 80,
        "cache": "c",
        "concurrency": 64,
        "reference": "large",
        "max_rollouts": 4,
    }
    kw = pipeline_kwargs(build_parser().parse_args(["train", "r2r", *common, "--unverified", "divergent"]))
    assert (kw["unverified"], kw["offset"], kw["cache"], kw["max_new_tokens"]) == ("divergent", 556, "c", 80)
    kw = pipeline_kwargs(build_parser().parse_args(["train", "co_llm", "--limit", "5"]))
    assert kw["reference"] == "gold" and "max_new_tokens" not in kw and kw["offset"] == 0


def test_the_query_pipeline_takes_the_concurrency_of_its_generations():
    from tokenrouter_sdk.cli.main import build_parser
    from tokenrouter_sdk.cli.train import pipeline_kwargs

    kw = pipeline_kwargs(build_parser().parse_args(["train", "query", "--concurrency", "8", "--max-new-tokens", "64"]))
    assert (kw["concurrency"], kw["max_new_tokens"], kw["reference"]) == (8, 64, "gold")
    assert "cache" not in kw  # its generations are not cached
