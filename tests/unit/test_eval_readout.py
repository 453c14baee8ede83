"""What a sweep's table and files say, on the simulator (random tokens: no answer is ever
extracted, as with a pair that writes no number): a missing answer never agrees and has its own
column beside answer and token agreement; the question set is printed above the table; the
RouteLLM summaries appear only where the policy's points carry them (n/a with the reason
otherwise); every plot is written as a static PNG and PDF with readable numbers."""

import json
import tempfile
from pathlib import Path

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.backends.sim_runner import LatencyModel
from tokenrouter_sdk.eval import EvalResult, evaluate_policies, evaluate_policy, load_benchmark
from tokenrouter_sdk.eval.stats import gain_summary
from tokenrouter_sdk.eval.sweep import _summaries
from tokenrouter_sdk.models import tiny_tokenizer
from tokenrouter_sdk.policies import LargeOnly

LAT = {
    "small": LatencyModel({1: 0.02, 8: 0.03}, per_token_s=0.001),
    "large": LatencyModel({1: 0.06, 8: 0.09}, per_token_s=0.003),
}


def bench(n: int = 8):
    path = Path(tempfile.mkdtemp()) / "q.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": f"What is {i} plus {i}?", "answer": str(2 * i)}) + "\n"
            for i in range(n)
        )
    )
    return load_benchmark(path, template="{question}", seed=None)


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("readout")
    with Router(LAT, backend="sim", tokenizer=tiny_tokenizer()) as r:
        res = evaluate_policy(
            r,
            "random",
            [0.3],
            dataset=bench(),
            max_new_tokens=4,
            concurrency=4,
            progress=False,
            repeats=1,
            references=["large_only", "small_only"],
            out_dir=out,
        )
    return res, out


def test_a_missing_answer_never_agrees_and_has_its_own_column(res):
    res, _ = res
    assert all(a["pred"] is None for ans in res.answers.values() for a in ans)  # nobody wrote an answer
    for rec in res.records:
        assert rec["agreement"] == 0.0 and rec["no_answer"] == 1.0 and rec["accuracy"] == 0.0
        assert all(a["agrees"] is False for a in res.answers[rec["label"]])
    small = next(r for r in res.records if r["kind"] == "small_only")
    assert small["token_agreement_prefix"] == 0.0  # and the tokens differ too
    head = res.table().splitlines()[1].split()
    assert head[head.index("no_ans") + 1 : head.index("no_ans") + 3] == ["ans_agree", "tok_agree"]


def test_the_question_set_is_printed_above_the_table(res):
    res, _ = res
    first = res.table().splitlines()[0]
    assert first.startswith(f"questions: 8 of q (file order; set {res.question_set()})")
    assert (
        res.question_set() == EvalResult(res.records, {"dataset": {"ids": [f"q{i}" for i in range(8)]}}).question_set()
    )
    assert res.question_set() != EvalResult([], {"dataset": {"ids": [f"q{i}" for i in range(7)]}}).question_set()
    assert "questions: 8 of q" in res._repr_html_().split("<table")[0]


def test_a_policy_without_arguments_runs_as_one_point():
    with Router(LAT, backend="sim", tokenizer=tiny_tokenizer()) as r:
        res = evaluate_policies(
            r,
            {"random": ("random", [0.3]), "large": LargeOnly()},
            dataset=bench(4),
            max_new_tokens=4,
            concurrency=4,
            progress=False,
            repeats=1,
            references=["small_only"],
        )
    rec = next(r for r in res.records if r["label"] == "large")
    assert rec["kind"] == "sweep" and rec["param"] is None and rec["value"] is None and rec["large_fraction"] == 1.0
    assert "large" in {t.name for t in res.plot("large_fraction").data}


def test_every_plot_is_written_as_png_and_pdf_with_readable_numbers(res, tmp_path):
    res, out = res
    want = {f"{y}_vs_{x}.{f}" for x, y in res.plots() for f in ("png", "pdf")}
    assert len(res.plots()) == 4 and {p.name for p in (out / "figures").iterdir()} == want
    for p in (out / "figures").iterdir():
        head = p.read_bytes()[:8]
        assert p.stat().st_size > 2000 and head.startswith(b"\x89PNG" if p.suffix == ".png" else b"%PDF")
    recs = [dict(r) for r in res.records]
    recs[2]["value"] = 0.301998
    svg = EvalResult(recs, res.config).save_figures(tmp_path, formats=("svg",))
    assert [p.name for p in svg] == [f"{y}_vs_{x}.svg" for x, y in res.plots()]
    fig = EvalResult(recs, res.config).static_plot("large_fraction")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "0.302" in texts and not any("0.301998" in t for t in texts)
    fig.canvas.draw()
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels() + fig.axes[0].get_yticklabels()]
    assert ticks and all(len(t.replace("\u2212", "-").lstrip("-")) <= 5 for t in ticks), ticks
    plotly_fig = EvalResult(recs, res.config).plot("large_fraction")
    assert "0.302" in list(plotly_fig.data[0].text)
    with pytest.raises(ValueError, match="formats"):
        res.save_figures(tmp_path, formats=("gif",))


def test_summaries_only_where_the_points_carry_them():
    # one point that routed 0.1% of tokens and scored exactly small-only: nothing to summarise
    s = gain_summary([(0.001, 0.1)], small=0.1, large=0.2)
    assert s["apgr"] is None and s["large_fraction_50"] is None and s["large_fraction_80"] is None
    assert (
        "one point" in s["why_na"]["apgr"]
        and "straight line to large-only would put it at" in s["why_na"]["large_fraction_50"]
    )
    # two points spanning half the axis: APGR is the area under their curve
    s = gain_summary([(0.2, 0.3), (0.7, 0.9)], small=0.0, large=1.0)
    assert s["apgr"] == pytest.approx(0.2 * 0.15 + 0.5 * 0.6 + 0.3 * 0.95)
    assert s["large_fraction_50"] == pytest.approx(0.2 + 0.5 * 0.2 / 0.6)
    assert s["large_fraction_80"] == pytest.approx(0.2 + 0.5 * 0.5 / 0.6)
    s = gain_summary([(0.05, 0.6), (0.1, 0.7)], small=0.0, large=1.0)  # 50% reached before the first point
    assert s["apgr"] is None and "95%" in s["why_na"]["apgr"]
    assert (
        s["large_fraction_50"] is None
        and "below the policy's least large fraction 0.05" in s["why_na"]["large_fraction_50"]
    )
    assert gain_summary([(0.5, 0.5)], small=0.0, large=1.0)["large_fraction_50"] == pytest.approx(0.5)  # at a point
    # the table says n/a and why
    recs = [
        {"kind": "small_only", "accuracy": 0.1, "agreement": 0.5, "label": "small_only"},
        {"kind": "large_only", "accuracy": 0.2, "agreement": 1.0, "label": "large_only"},
        {
            "kind": "sweep",
            "policy": "RStitch",
            "policy_name": "rstitch",
            "label": "rstitch(tau=0.3)",
            "large_fraction": 0.001,
            "accuracy": 0.1,
            "agreement": 0.5,
            "answered": 24,
            "failed": 0,
        },
    ]
    table = EvalResult(recs, {}, {}, {"summaries": _summaries(recs)}).summary_table()
    row = next(line for line in table.splitlines() if line.startswith("rstitch") and "accuracy" in line)
    assert row.split()[-3:] == ["n/a", "n/a", "n/a"] and "0.500" not in table
    assert "n/a: rstitch accuracy APGR: one point (large fraction 0.001)" in table
