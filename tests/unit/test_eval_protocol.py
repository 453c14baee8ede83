"""What a sweep's numbers mean: failed requests are counted and never scored, every timed run
starts from the same cache state in interleaved repeats (on the simulator: deterministic time),
the span-matched random reference realises its targets, several policies share one question
set, and the paired statistics and RouteLLM summaries are what their definitions say."""

import argparse
import json

import pytest

from tokenrouter_sdk import Policy, Router
from tokenrouter_sdk.backends.sim_runner import LatencyModel
from tokenrouter_sdk.eval import evaluate_policies, evaluate_policy, load_benchmark
from tokenrouter_sdk.eval.references import check_reference
from tokenrouter_sdk.eval.stats import gain_summary, paired_bootstrap, token_agreement, visits_from_trace
from tokenrouter_sdk.models import tiny_tokenizer
from tokenrouter_sdk.policies import QueryRouter, RandomRouting, RandomSpanRouting, RStitch

from ..helpers import save_tiny_pair

QS = ["2+3?", "7*6?", "10-4?", "9/3?"]
LAT = {
    "small": LatencyModel({1: 0.02, 8: 0.03}, per_token_s=0.001),
    "large": LatencyModel({1: 0.06, 8: 0.09}, per_token_s=0.003),
}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    path = d / "tiny.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "question": q, "answer": "5"}) + "\n" for i, q in enumerate(QS)))
    return load_benchmark(path, template="Q: {question} Think it through.", seed=None)


class FailsOnSeven(Policy):
    """Stays on the first model; every request whose prompt holds a 7 fails at its first step."""

    def route(self, step):
        if "7" in step.tokenizer.decode(step.request.prompt_ids):
            raise RuntimeError("no sevens")
        return step.model


def test_failed_requests_are_counted_not_scored(pair, tok, bench):
    with Router(pair, tokenizer=tok) as r:
        res = evaluate_policy(
            r,
            lambda v: FailsOnSeven(),
            [0],
            dataset=bench,
            max_new_tokens=12,
            concurrency=4,
            references=["large_only", "small_only"],
            progress=False,
            repeats=1,
        )
    recs = {x["label"]: x for x in res.records}
    bad, small = recs["FailsOnSeven(value=0)"], recs["small_only"]
    assert (bad["n"], bad["answered"], bad["failed"], bad["flagged"]) == (4, 3, 1, True)
    assert "no sevens" in bad["first_error"]
    ans = res.answers[bad["label"]]
    assert [a["ok"] for a in ans] == [True, False, True, True] and ans[1]["agrees"] is None and not ans[1]["correct"]
    # scored over the 3 answered: the same answers as small-only on those questions
    same = [a for i, a in enumerate(res.answers["small_only"]) if i != 1]
    assert bad["agreement_n"] == 3
    assert bad["agreement"] == pytest.approx(sum(a["agrees"] for a in same) / 3)
    assert bad["accuracy"] == sum(a["correct"] for a in same) / 3
    assert bad["tokens_per_answer"] == sum(a["tokens"] for a in same) / 3
    assert small["failed"] == 0 and small["agreement_n"] == 4
    # the table's failed column and a note say so
    table = res.table()
    assert table.splitlines()[0].startswith("questions: 4 of tiny")  # the question set, above the table
    assert "failed" in table.splitlines()[1] and "1/4 !" in table
    assert any(line.startswith("FAILED: FailsOnSeven(value=0): 1 of 4 requests failed") for line in res.notes())
    assert res.failures == [{"label": bad["label"], "failed": 1, "n": 4, "first_error": bad["first_error"]}]
    fig = res.plot()
    assert any(t.name == "points with failed requests" for t in fig.data)


POLICY_FILE = """
from tokenrouter_sdk import Policy

class Broken(Policy):
    def __init__(self, level: float = 0.3):
        self.level = level

    def route(self, step):
        raise RuntimeError("broken on purpose")
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"))


def test_eval_exits_non_zero_when_every_request_fails_and_shows_why(folders, tmp_path, capsys):
    from tokenrouter_sdk.cli.eval import add_arguments, cmd_eval

    (tmp_path / "broken.py").write_text(POLICY_FILE)
    argv = [
        "--model",
        f"small={folders[0]}",
        "--model",
        f"large={folders[1]}",
        "--transport",
        "thread",
        "--policy-file",
        f"{tmp_path / 'broken.py'}:Broken",
        "--param",
        "level",
        "--values",
        "0.3",
        "--limit",
        "2",
        "--max-new-tokens",
        "3",
        "--repeats",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path / "o"),
    ]
    args = add_arguments(argparse.ArgumentParser()).parse_args(argv)
    assert cmd_eval(args) == 1
    out, err = capsys.readouterr()
    assert "Broken(level=0.3)" in out and "2/2 !" in out
    assert "FAILED: Broken(level=0.3): 2 of 2 requests failed" in out and "broken on purpose" in out
    assert "not run for Broken(level=0.3): none of its 2 requests was answered" in out  # the references say why
    assert "requests failed in 1 point(s)" in err and "--allow-failures" in err
    rec = next(r for r in json.loads((tmp_path / "o" / "results.json").read_text())["records"] if r["kind"] == "sweep")
    assert rec["accuracy"] is None and rec["agreement"] is None and rec["throughput_tok_s"] is None
    args.allow_failures = True
    assert cmd_eval(args) == 0  # resumed from the saved point; the failures stay in the results


def test_points_are_timed_in_interleaved_repeats_from_one_cache_state():
    """On the simulator (deterministic time): with the cache cleared before each run, every run
    of every point prefills the same prompt tokens on its entry model and a point's repeats take
    the same time; the runs go forward, then backward; with the cache kept they do not."""
    qs = [f"Question {i}: what is {i} plus {i}? Think step by step." for i in range(6)]
    bench = load_benchmark_rows(qs)
    with Router(LAT, backend="sim", tokenizer=tiny_tokenizer()) as r:
        res = evaluate_policy(
            r,
            "random",
            [0.2],
            dataset=bench,
            max_new_tokens=16,
            concurrency=3,
            progress=False,
            repeats=3,
            references=["large_only", "small_only", "random"],
        )
    labels = [x["label"] for x in res.records]
    assert labels == [
        "large_only",
        "small_only",
        "RandomRouting(p=0.2)",
        f"RandomRouting(p={res.records[2]['large_fraction']:.3g})",
    ]
    order = res.config["run_order"]
    assert order == [[0, x] for x in labels] + [[1, x] for x in labels[::-1]] + [[2, x] for x in labels]
    fed = set()
    for x in res.records:
        assert x["repeats"] == 3 and len(x["throughput_runs"]) == 3
        assert x["throughput_min"] == pytest.approx(x["throughput_max"]) == pytest.approx(x["throughput_tok_s"])
        entry = "large" if x["kind"] == "large_only" else "small"
        fed |= {runs[entry] for runs in x["prompt_fed_runs"]}
        assert x["repeat_mismatches"] == 0
    assert len(fed) == 1 and fed.pop() > 0  # every run of every point found the same (empty) cache
    assert res.config["timing"]["cache"] == "clear" and res.config["timing"]["clock"] == "simulated"
    with Router(LAT, backend="sim", tokenizer=tiny_tokenizer()) as r:
        kept = evaluate_policy(
            r,
            "random",
            [0.2],
            dataset=bench,
            max_new_tokens=16,
            concurrency=3,
            progress=False,
            repeats=2,
            references=["large_only", "small_only"],
            cache="keep",
        )
    fed = {
        runs["large" if x["kind"] == "large_only" else "small"] for x in kept.records for runs in x["prompt_fed_runs"]
    }
    assert len(fed) > 1  # kept: later runs reuse the prompt blocks earlier ones left
    assert kept.records[0]["throughput_min"] < kept.records[0]["throughput_max"]


def load_benchmark_rows(questions):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "q.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"q{i}", "question": q, "answer": "2"}) + "\n" for i, q in enumerate(questions))
    )
    return load_benchmark(path, template="{question}", seed=None)


def test_span_matched_random_realises_its_large_fraction_and_visit_lengths():
    """`RandomSpanRouting` on the simulator: geometric visits with the given means; the realised
    large fraction and mean visit lengths (counted at the handoffs) fall in their 95% sampling
    ranges and its hop rate is what the visit lengths give (2 / (3 + 6)), not twice the large
    fraction; `RandomRouting` (p) is its case large_visit=1, small_visit=(1 - p) / p."""

    def run(pol):
        with Router(LAT, pol, backend="sim") as r:
            outs = r.generate([[5 + i] * 8 for i in range(32)], max_new_tokens=64, ignore_eos=True)
            visits = visits_from_trace(r.trace, [o.rid for o in outs])
            m = r.metrics()
        assert all(o.ok and [w for w, n in visits[o.rid] for _ in range(n)] == o.token_models for o in outs)
        return [
            {
                "ok": True,
                "tokens": len(o.token_ids),
                "large_tokens": o.token_models.count("large"),
                "visits": visits[o.rid],
            }
            for o in outs
        ], m

    ans, m = run(RandomSpanRouting(large_visit=3, small_visit=6, seed=1))
    rec = {
        "kind": "random_span",
        "label": "span",
        "matched_to": "P",
        "value": 3.0,
        "targets": {"large_fraction": 1 / 3, "mean_large_visit": 3.0, "mean_small_visit": 6.0},
    }
    assert check_reference(rec, ans, "large") is None and rec["matches_target"] and rec["visits_match"]
    lo, hi = rec["target_range"]
    assert lo < 1 / 3 < hi and hi - lo < 0.1
    assert rec["large_visit_range"][0] < 3 < rec["large_visit_range"][1]
    assert rec["small_visit_range"][0] < 6 < rec["small_visit_range"][1]
    assert abs(m.hop_rate - 2 / 9) < 0.03 and m.hop_rate < 1.5 * m.large_fraction
    assert m.writer_changes < m.hops  # an empty small stretch: a hop with no writer change
    # the same check flags a reference whose visits are far from the target
    off = dict(rec, targets={"large_fraction": 1 / 3, "mean_large_visit": 1.0, "mean_small_visit": 2.0})
    assert "visits" in check_reference(off, ans, "large") and off["matches_target"] is False
    # RandomRouting's visits, as a span-matched reference measures them: spans of 1, stretches of (1 - p) / p
    ans, m = run(RandomRouting(p=0.3, seed=2))
    rec = {
        "kind": "random_span",
        "label": "span",
        "matched_to": "P",
        "value": 1.0,
        "targets": {"large_fraction": 0.3, "mean_large_visit": 1.0, "mean_small_visit": 0.7 / 0.3},
    }
    assert check_reference(rec, ans, "large") is None and rec["realised_large_visit"] == 1.0


def _query_head(tmp_path, train_ids):
    from tokenrouter_sdk.policies.query_level import save_query_head

    path = tmp_path / "q.pt"
    save_query_head(
        QueryRouter.random_head(64, seed=3),
        path,
        meta={"data": {"source": "tiny", "train_ids": list(train_ids), "val_ids": []}},
    )
    return path


def test_several_policies_share_one_question_set_and_one_set_of_references(pair, tok, bench, tmp_path):
    head = _query_head(tmp_path, ["t1"])
    with Router(pair, tokenizer=tok) as r, pytest.warns(UserWarning, match="left out 1 of the 4"):
        res = evaluate_policies(
            r,
            {
                "rstitch": (RStitch, [0.8], "tau"),
                "query": (lambda v: QueryRouter(head, threshold=v), [0.5], "threshold"),
                "random": ("random", [0.3]),
            },
            dataset=bench,
            max_new_tokens=8,
            concurrency=4,
            progress=False,
            repeats=1,
        )
    kinds = [x["kind"] for x in res.records]
    assert kinds.count("large_only") == 1 and kinds.count("small_only") == 1
    assert [x["label"] for x in res.records if x["kind"] == "sweep"] == [
        "rstitch(tau=0.8)",
        "query(threshold=0.5)",
        "random(p=0.3)",
    ]
    ids = {tuple(a["id"] for a in ans) for ans in res.answers.values()}
    assert ids == {("t0", "t2", "t3")}  # the query head's training question is left out for every policy
    assert res.config["dataset"]["ids"] == ["t0", "t2", "t3"]
    names = {s["policy"] for s in res.summaries}
    assert names == {"rstitch", "query", "random"}
    assert {p["point"] for p in res.paired} == {"rstitch(tau=0.8)", "query(threshold=0.5)", "random(p=0.3)"}
    fig = res.plot(x="large_fraction", y="agreement")
    assert {"rstitch (tau)", "query (threshold)", "random (p)"} <= {t.name for t in fig.data}


def test_python_defaults_are_the_command_line_defaults():
    """Without values a learned head runs its calibrated point and a training-free policy the
    CLI's five values, in Python as on the command line."""
    from tokenrouter_sdk.cli.eval import DEFAULT_VALUES, add_arguments, sweeps
    from tokenrouter_sdk.eval.sweep import default_values
    from tokenrouter_sdk.policies import R2R

    assert default_values("r2r") == [R2R().tau]
    assert default_values("rstitch") == DEFAULT_VALUES["rstitch"]
    cli = {
        name: values
        for name, _, _, values in sweeps(
            add_arguments(argparse.ArgumentParser()).parse_args(
                ["--pair", "smollm2", "--policy", "r2r", "--policy", "rstitch"]
            )
        )
    }
    assert cli == {"r2r": default_values("r2r"), "rstitch": default_values("rstitch")}
    with pytest.raises(ValueError, match="give values"):
        default_values(lambda v: RandomRouting(p=v))


def test_paired_statistics_summaries_and_token_agreement_follow_their_definitions():
    d = paired_bootstrap([1, 1, 1, 0], [0, 1, 0, 0])
    assert d["n"] == 4 and d["diff"] == 0.5 and 0.0 <= d["ci_low"] < 0.5 < d["ci_high"] <= 1.0
    assert paired_bootstrap([1, 1, 1, 0], [0, 1, 0, 0]) == d  # seeded
    assert paired_bootstrap([1, 0], [1, 0]) == {"n": 2, "diff": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    s = gain_summary([(0.5, 0.5)], small=0.0, large=1.0)  # one point on the straight line
    assert s["large_fraction_50"] == pytest.approx(0.5)  # reached at the point itself
    assert s["apgr"] is None and s["large_fraction_80"] is None  # the rest would be the line, not the policy
    s = gain_summary([(0.25, 0.8), (0.8, 0.9)], small=0.0, large=1.0)  # 80% of the gain at a quarter large
    assert s["large_fraction_80"] == pytest.approx(0.25) and s["large_fraction_50"] is None  # below its first point
    assert s["apgr"] == pytest.approx(0.25 * 0.4 + 0.55 * 0.85 + 0.2 * 0.95)
    assert gain_summary([(0.5, 0.5)], small=0.6, large=0.6)["apgr"] is None
    assert token_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == (0.5, 0.75)
    assert token_agreement([[1, 2]], [[1, 2, 3, 4]]) == (0.5, 0.5)
    assert token_agreement([], []) is None
