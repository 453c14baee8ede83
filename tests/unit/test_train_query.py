"""Query-level router training on tiny models: labels from the answer check, training,
the threshold's large share, files, and QueryRouter sending exactly the low-p prompts to the
large model in the engine."""

import json

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate
from tokenrouter_sdk.policies.heads import load_head
from tokenrouter_sdk.train.common import Pair, forward_features
from tokenrouter_sdk.train.data import Example
from tokenrouter_sdk.train.query import train_query

EXS = [
    Example(f"q{i}", ("Easy sum: " if i % 2 else "Hard integral of x^") + str(i), "yes" if i % 2 else "no")
    for i in range(12)
]


def _check(text, ex):  # "correct" iff the example says so: labels are known by hand
    return ex.answer == "yes"


@pytest.fixture(scope="module")
def pair():
    large = tiny_model(num_layers=2, seed=3)
    return truncate(large, 1), large, tiny_tokenizer()


def test_one_class_is_refused(pair, tmp_path):
    small, large, tok = pair
    with pytest.raises(ValueError, match="both outcomes"):
        train_query(
            {"small": small, "large": large},
            EXS[:4],
            tokenizer=tok,
            out=tmp_path,
            max_new_tokens=2,
            check=lambda t, e: False,
            progress=False,
        )


def test_train_query_end_to_end(pair, tmp_path):
    small, large, tok = pair
    res = train_query(
        {"small": small, "large": large},
        EXS,
        tokenizer=tok,
        out=tmp_path,
        max_new_tokens=4,
        check=_check,
        large_share=0.5,
        progress=False,
    )
    sd, cfg, meta = load_head(res.head_path, "query")
    assert json.loads(res.meta_path.read_text()) == meta and cfg == {"hidden_size": 64, "hidden_dim": 0}
    assert meta["labels_per_prompt"] == {e.id: int(e.answer == "yes") for e in EXS}
    assert min(res.history["train_loss"]) < res.history["initial_train_loss"]
    assert res.metrics["val"]["auc"] == 1.0  # the classes differ in their prompt text
    assert res.metrics["large_share_train"] == pytest.approx(0.5, abs=0.1)
    pol = res.policy()
    with Pair({"small": small, "large": large}, tok) as pr:
        p = torch.stack([forward_features(small, pr.encode(e.prompt))[0][-1] for e in EXS])
    to_large = (pol._head(p) < res.threshold).tolist()
    assert 0 < sum(to_large) < len(EXS)
    with Router({"small": small, "large": large}, pol, tokenizer=tok) as router:
        outs = router.generate([e.prompt for e in EXS], max_new_tokens=6)
    for o, big in zip(outs, to_large):
        assert o.ok and set(o.token_models) == {"large" if big else "small"}


def test_reference_large_labels_agreement_with_the_large_model(pair, tmp_path):
    from tokenrouter_sdk.eval.answers import answers_agree, extract_answer

    small, large, tok = pair
    exs = [Example(f"n{i}", f"Add {i} and {i + 3}, then {i}", "") for i in range(10)]
    with pytest.raises(ValueError, match="reference must be 'gold' or 'large'"):
        train_query({"small": small, "large": large}, exs, tokenizer=tok, out=tmp_path, reference="judge")
    with Pair({"small": small, "large": large}, tok) as pr:
        ids = [pr.encode(e.prompt) for e in exs]
        s, lg = pr.generate(ids, "small", max_new_tokens=6), pr.generate(ids, "large", max_new_tokens=6)
    want = {e.id: int(answers_agree(extract_answer(a.text), extract_answer(b.text))) for e, a, b in zip(exs, s, lg)}
    if len(set(want.values())) < 2:
        pytest.skip("tiny models gave one class")
    res = train_query(
        {"small": small, "large": large},
        exs,
        tokenizer=tok,
        out=tmp_path,
        max_new_tokens=6,
        reference="large",
        progress=False,
    )
    assert res.meta["labels_per_prompt"] == want and res.meta["hyperparameters"]["reference"] == "large"
    assert res.metrics["labels"] == {"prompts": 10, "positive": sum(want.values()), "reference": "large"}
