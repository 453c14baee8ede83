"""The whole quality sweep on a tiny float64 pair and 4 questions: records, reference points,
agreement, resume after an interruption, recorded configuration, plots, save/load, CLI wiring."""

import json

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.eval import EvalResult, evaluate_policy, extract_answer, load_benchmark
from tokenrouter_sdk.eval.plots import pareto_frontier
from tokenrouter_sdk.policies import LargeOnly, QueryRouter, RStitch, SmallOnly

SAMPLING = dict(max_new_tokens=24, concurrency=4, progress=False)
VALUES = [0.75, 0.8, 0.9]


@pytest.fixture(scope="module")
def bench(tmp_path_factory, pair, tok):
    """4 short questions whose gold answers are set so the tiny large model is right on exactly
    the questions where its greedy output holds a number (2 of them are made wrong on purpose)."""
    d = tmp_path_factory.mktemp("data")
    qs = ["2+3?", "7*6?", "10-4?", "9/3?"]
    tpl = "Q: {question}"
    with Router(pair, LargeOnly(), tokenizer=tok) as r:
        outs = r.generate([tpl.format(question=q) for q in qs], max_new_tokens=24)
    preds = [extract_answer(o.text) for o in outs]
    gold = [p if (p is not None and i % 2 == 0) else "123456789" for i, p in enumerate(preds)]
    path = d / "tiny.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "question": q, "answer": a}) + "\n" for i, (q, a) in enumerate(zip(qs, gold))
        )
    )
    b = load_benchmark(path, template=tpl, seed=None)
    return b, sum(g != "123456789" for g in gold)


def test_sweep_records_references_resume_and_config(pair, tok, bench, tmp_path):
    b, n_right = bench
    out = tmp_path / "out"
    calls = []

    def flaky(tau):  # simulates an interrupted run: dies when the second swept point starts
        calls.append(tau)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return RStitch(tau=tau)

    with Router(pair, tokenizer=tok) as r:
        with pytest.raises(KeyboardInterrupt):
            evaluate_policy(r, flaky, VALUES, dataset=b, out_dir=out, param="tau", **SAMPLING)
        done = sorted(p.name.split("-")[0] for p in (out / "points").glob("*.json"))
        assert done == ["RStitch_tau=0.75_", "large_only", "small_only"]
        res = evaluate_policy(r, RStitch, VALUES, dataset=b, out_dir=out, param="tau", **SAMPLING)

    recs = {x["label"]: x for x in res.records}
    kinds = [x["kind"] for x in res.records]
    assert kinds[:5] == ["large_only", "small_only", "sweep", "sweep", "sweep"]
    assert [x["resumed"] for x in res.records[:5]] == [True, True, True, False, False]
    # exact bookkeeping: large-only is right on the questions we made right, agrees with itself
    L, S = recs["large_only"], recs["small_only"]
    assert L["n"] == 4 and L["correct"] == n_right and L["accuracy"] == n_right / 4
    assert L["acc_ci_low"] < L["accuracy"] < L["acc_ci_high"] or n_right in (0, 4)
    assert L["agreement"] == L["extracted"]  # agrees with itself where it wrote an answer (a missing one never agrees)
    assert L["no_answer"] == 1 - L["extracted"] and L["large_fraction"] == 1.0 and L["hop_rate"] == 0.0
    assert S["large_fraction"] == 0.0 and S["hop_rate"] == 0.0
    for x in res.records:
        ans = res.answers[x["label"]]
        assert x["correct"] == sum(a["correct"] for a in ans)
        assert x["agreement"] == sum(a["agrees"] for a in ans) / 4
        assert x["tokens_per_answer"] == sum(a["tokens"] for a in ans) / 4
        assert x["large_fraction"] == pytest.approx(sum(a["large_tokens"] for a in ans) / sum(a["tokens"] for a in ans))
        assert x["hops"] == sum(a["hops"] for a in ans)
        assert x["throughput_tok_s"] > 0 and x["mean_latency_s"] > 0
    # matched references: one RandomRouting and one RandomQueryRouting per distinct fraction in (0, 1)
    fr = sorted({round(x["large_fraction"], 3) for x in res.records if x["kind"] == "sweep"} - {0.0, 1.0})
    assert fr, "the chosen taus should give at least one mixed operating point"
    assert sorted(x["value"] for x in res.records if x["kind"] == "random") == fr
    assert sorted(x["value"] for x in res.records if x["kind"] == "random_query") == fr
    for x in res.records:
        if x["kind"] == "random":
            assert x["hop_rate"] > 0 and recs[x["matched_to"]]["kind"] == "sweep"
        if x["kind"] == "random_query":
            assert x["hop_rate"] == 0.0
    # configuration recorded, and a rerun of the finished sweep is all resumed and identical
    cfg = res.config
    assert cfg["router"]["models"]["large"]["num_hidden_layers"] == 4
    assert cfg["router"]["models"]["small"]["num_hidden_layers"] == 2
    assert cfg["router"]["mode"] == "async" and cfg["concurrency"] == 4
    assert cfg["dataset"]["ids"] == ["t0", "t1", "t2", "t3"] and cfg["sampling"]["max_new_tokens"] == 24
    assert cfg["policies"]["RStitch(tau=0.8)"] == {
        "class": "tokenrouter_sdk.policies.rstitch.RStitch",
        "params": {"tau": 0.8, "tau_back": 0.8, "signal": "entropy", "small": None, "large": None},
    }
    assert cfg["versions"]["torch"] and cfg["versions"]["transformers"]
    with Router(pair, tokenizer=tok) as r:
        again = evaluate_policy(r, RStitch, VALUES, dataset=b, out_dir=out, param="tau", **SAMPLING)
        assert all(x["resumed"] for x in again.records)
        assert [x["accuracy"] for x in again.records] == [x["accuracy"] for x in res.records]

    # saved files, load round trip, table and plots
    assert {p.name for p in out.iterdir()} >= {"results.csv", "results.json", "plot.html", "points"}
    html = (out / "plot.html").read_text()
    assert "Pareto frontier" in html and len(html) > 1_000_000  # plotly.js inlined: works offline
    back = EvalResult.load(out)
    assert back.records == again.records and back.config["dataset"]["ids"] == cfg["dataset"]["ids"]
    df = back.to_pandas()
    assert list(df["label"]) == [x["label"] for x in again.records] and "agreement" in df.columns
    assert "RStitch(tau=0.8)" in back.table() and "ans_agree" in back.table()
    for x in ("throughput", "large_fraction"):
        fig = back.plot(x=x)
        names = [t.name for t in fig.data]
        assert "Pareto frontier" in names and "large only" in names and "small only" in names
        assert "RandomRouting (matched)" in names and "RStitch (tau)" in names
        front = next(t for t in fig.data if t.name == "Pareto frontier")
        assert len(front.x) == len(back.frontier(x)) >= 1
    with pytest.raises(ValueError, match="plot x"):
        back.plot(x="cost")
    # a different sampling config does not reuse the points
    with Router(pair, tokenizer=tok) as r:
        other = evaluate_policy(
            r,
            RStitch,
            [0.8],
            dataset=b,
            out_dir=out,
            param="tau",
            references=["large_only"],
            **{**SAMPLING, "max_new_tokens": 8},
        )
    assert not any(x["resumed"] for x in other.records) and other.records[1]["tokens_per_answer"] <= 8


def test_pareto_frontier_values():
    pts = [(10, 0.5), (20, 0.4), (5, 0.6), (15, 0.3), (20, 0.45)]
    assert pareto_frontier(pts, x_higher_better=True) == [2, 0, 4]
    # lower x better (large fraction): (5, 0.6) dominates everything but nothing beats it
    assert pareto_frontier(pts, x_higher_better=False) == [2]


def test_bad_arguments(pair, tok, bench):
    b, _ = bench
    with Router(pair, tokenizer=tok) as r:
        with pytest.raises(ValueError, match="values is empty"):
            evaluate_policy(r, "rstitch", [], dataset=b)
        with pytest.raises(ValueError, match="unknown references"):
            evaluate_policy(r, "rstitch", [0.1], dataset=b, references=["oracle"])
        with pytest.raises(ValueError, match="unknown policy 'magic'"):
            evaluate_policy(r, "magic", [0.1], dataset=b)
        with pytest.raises(TypeError, match="policy_factory"):
            evaluate_policy(r, 3, [0.1], dataset=b)
        with pytest.raises(TypeError, match="router_or_models"):
            evaluate_policy(42, "rstitch", [0.1], dataset=b)


def test_small_only_only_and_dict_of_models(pair, tok, bench):
    b, _ = bench
    res = evaluate_policy(pair, lambda v: SmallOnly(), [0], dataset=b, references=False, tokenizer=tok, **SAMPLING)
    (x,) = res.records
    assert x["agreement"] is None and x["large_fraction"] == 0.0 and x["label"] == "SmallOnly(value=0)"
    with Router(pair, tokenizer=tok) as r:  # a lambda: the parameter is named after the policy attribute
        res = evaluate_policy(r, lambda t: RStitch(tau=t), [0.9], dataset=b, references=False, **SAMPLING)
    assert res.records[0]["label"] == "RStitch(tau=0.9)" and res.records[0]["param"] == "tau"


def test_cli_parser_has_eval():
    from tokenrouter_sdk.cli.main import build_parser

    a = build_parser().parse_args(["eval", "--values", "0.02,0.05", "--limit", "16", "--out", "x"])
    assert a.values == [0.02, 0.05] and a.limit == 16 and a.policy is None and a.fn.__name__ == "cmd_eval"
    assert a.repeats == 2 and a.cache == "clear" and not a.allow_failures
    from tokenrouter_sdk.cli.eval import sweeps

    assert [(n, p, v) for n, _, p, v in sweeps(a)] == [("rstitch", "tau", [0.02, 0.05])]  # the default policy
    a = build_parser().parse_args(["eval", "--policy", "rstitch@0.1,0.2", "--policy", "random", "--values", "0.3"])
    assert [(n, p, v) for n, _, p, v in sweeps(a)] == [("rstitch", "tau", [0.1, 0.2]), ("random", "p", [0.3])]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--values", "a,b"])


def _query_head_with_record(tmp_path, train_ids, val_ids=(), calibration_ids=()):
    """A query head for the tiny pair (hidden size 64) whose record lists these question ids."""
    from tokenrouter_sdk.policies.query_level import save_query_head

    path = tmp_path / "q.pt"
    meta = {
        "data": {"source": "tiny", "train_ids": list(train_ids), "val_ids": list(val_ids)},
        "default_threshold": {"value": 0.5, "calibration_ids": list(calibration_ids)},
    }
    save_query_head(QueryRouter.random_head(64, seed=3), path, meta=meta)
    return path


def test_a_learned_head_is_not_scored_on_its_training_questions(pair, tok, bench, tmp_path):
    b, _ = bench
    head = _query_head_with_record(tmp_path, ["t1"], ["t2"], ["t1"])
    with Router(pair, tokenizer=tok) as r:
        with pytest.warns(UserWarning, match=r"left out 2 of the 3 questions drawn .*QueryRouter's \(2 ids\) head"):
            res = evaluate_policy(
                r,
                lambda v: QueryRouter(head, threshold=v),
                [0.5],
                dataset=b.source,
                limit=3,
                seed=None,
                references=["large_only"],
                **SAMPLING,
            )
        assert res.excluded["in_draw"] == 2 and res.excluded["ids"] == ["t1", "t2"]
        assert res.excluded["heads"] == {"QueryRouter": 2} and res.excluded["in_benchmark"] == 2
        for label, ans in res.answers.items():  # the next question in file order took their places
            assert [a["id"] for a in ans] == ["t0", "t3"], label
        assert res.config["dataset"]["ids"] == ["t0", "t3"]
        assert (
            any("leaving out 2 of the 3 first drawn" in line for line in res.notes()) and "leaving out" in res.table()
        )
        # a loaded Benchmark: the questions are dropped (nothing to take their places)
        with pytest.warns(UserWarning, match="left out 2 of the 4"):
            res = evaluate_policy(
                r, lambda v: QueryRouter(head, threshold=v), [0.5], dataset=b, references=False, **SAMPLING
            )
        assert [a["id"] for a in res.answers["QueryRouter(threshold=0.5)"]] == ["t0", "t3"]
        # the explicit opt-out scores them, and says so
        res = evaluate_policy(
            r,
            lambda v: QueryRouter(head, threshold=v),
            [0.5],
            dataset=b,
            references=False,
            exclude_head_questions=False,
            **SAMPLING,
        )
        assert len(res.answers["QueryRouter(threshold=0.5)"]) == 4 and "excluded" not in res.config
        assert res.config["head_overlap"]["ids"] == ["t1", "t2"] and "were used to make" in res.table()
        # no head, nothing left out
        res = evaluate_policy(r, RStitch, [0.9], dataset=b, param="tau", references=False, **SAMPLING)
        assert res.excluded is None and len(res.answers["RStitch(tau=0.9)"]) == 4


def test_a_learned_head_trained_elsewhere_lets_the_other_points_resume(pair, tok, bench, tmp_path):
    b, _ = bench
    out = tmp_path / "out"
    far = _query_head_with_record(tmp_path, ["train-0"], ["train-1"], ["train-0"])  # no question of the draw
    with Router(pair, tokenizer=tok) as r:
        first = evaluate_policy(
            r, RStitch, [0.9], dataset=b, param="tau", out_dir=out, references=["large_only"], **SAMPLING
        )
        again = evaluate_policy(
            r,
            lambda v: QueryRouter(far, threshold=v),
            [0.5],
            dataset=b,
            out_dir=out,
            references=["large_only"],
            **SAMPLING,
        )
    assert again.excluded is None or again.excluded["in_benchmark"] == 0
    assert again.config["dataset"] == first.config["dataset"]  # the same questions, the same points
    recs = {x["kind"]: x for x in again.records}
    assert recs["large_only"]["resumed"] and not recs["sweep"]["resumed"]
    lines = again.notes()
    assert any("none of them was used to train" in line for line in lines), lines
    assert not any("leaving out 0" in line for line in lines)


def test_a_point_saved_under_another_label_resumes_by_its_configuration(pair, tok, bench, tmp_path):
    from tokenrouter_sdk.eval import evaluate_policies

    b, _ = bench
    out = tmp_path / "out"
    with Router(pair, tokenizer=tok) as r:
        one = evaluate_policy(r, RStitch, [0.9], dataset=b, param="tau", out_dir=out, references=False, **SAMPLING)
        both = evaluate_policies(
            r,
            {"rstitch": (RStitch, [0.9], "tau"), "stitch2": (RStitch, [0.8], "tau")},
            dataset=b,
            out_dir=out,
            references=False,
            **SAMPLING,
        )
    recs = {x["label"]: x for x in both.records}
    assert set(recs) == {"rstitch(tau=0.9)", "stitch2(tau=0.8)"}
    assert recs["rstitch(tau=0.9)"]["resumed"] and not recs["stitch2(tau=0.8)"]["resumed"]
    assert both.answers["rstitch(tau=0.9)"] == one.answers["RStitch(tau=0.9)"]
    assert recs["rstitch(tau=0.9)"]["policy_name"] == "rstitch"
    names = sorted(p.name.split("-")[0] for p in (out / "points").glob("*.json"))
    assert names == ["rstitch_tau=0.9_", "stitch2_tau=0.8_"]  # the file moved to the label it has now


def test_a_reference_off_its_target_is_flagged():
    from tokenrouter_sdk.eval.config import binomial_range
    from tokenrouter_sdk.eval.references import check_reference
    from tokenrouter_sdk.eval.result import EvalResult
    from tokenrouter_sdk.eval.sweep import _check_all

    assert binomial_range(4, 0.266) == (0.0, 0.75)
    lo, hi = binomial_range(1000, 0.3)
    assert 0.27 < lo < 0.3 < hi < 0.33
    ans = [{"ok": True, "tokens": 10, "large_tokens": 10}] * 4
    rec = {"label": "RandomQueryRouting(p=0.266)", "kind": "random_query", "matched_to": "R(x=1)", "value": 0.266}
    with pytest.warns(
        UserWarning,
        match=r"RandomQueryRouting\(p=0.266\) realised .* 1 on 4 questions, outside the "
        r"95% sampling range \[0, 0.75\] of its target 0.266",
    ):
        _check_all([rec], {rec["label"]: ans}, "large", warn=True)
    assert rec["matches_target"] is False and rec["target_range"] == [0.0, 0.75]
    assert any("does not match R(x=1)" in line for line in EvalResult([rec]).notes())
    ok = dict(rec, label="RandomQueryRouting(p=0.5)", value=0.5)
    assert (
        check_reference(
            ok,
            [{"ok": True, "tokens": 10, "large_tokens": 10}, {"ok": True, "tokens": 10, "large_tokens": 0}] * 2,
            "large",
        )
        is None
    )
    assert ok["matches_target"] is True and ok["realised"] == 0.5
    tok_level = {"label": "RandomRouting(p=0.3)", "kind": "random", "matched_to": "R(x=1)", "value": 0.3}
    text = check_reference(tok_level, [{"ok": True, "tokens": 500, "large_tokens": 250}] * 2, "large")
    assert "a large fraction of 0.5 on 1000 committed tokens" in text
    failed = [{"ok": False, "tokens": 500, "large_tokens": 500, "error": "x"}] * 2  # failed requests are not counted
    assert (
        check_reference(dict(tok_level), [{"ok": True, "tokens": 1000, "large_tokens": 300}] + failed, "large") is None
    )
