"""A threshold for a wanted large share (`tokenrouter_sdk.eval.calibrate`): the bisection on shares
a known function gives (both directions, a widened upper bound, the errors), a policy calibrated
in the engine, and a sweep whose points are calibrated on held-out questions and report the
target beside the realised share (also from the CLI's flags)."""

import json
import math

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.eval import calibrate_large_share, evaluate_policy
from tokenrouter_sdk.eval.calibrate import CalibrationError, _bisect, search_threshold
from tokenrouter_sdk.policies import RandomRouting

from ..helpers import mixed_prompts


def _search(share, target, bounds=(0.0, 1.0), rounds=8, tol=0.02):
    def run(v):
        return {"large_fraction": share(v)}

    lo, hi = bounds
    return search_threshold(run, target, [lo, hi], _bisect(target, lo, hi, "tau", tol), rounds=rounds, tol=tol)


@pytest.mark.parametrize(
    "share,target",
    [
        (lambda v: (1 - v) ** 3, 0.3),  # falls with the threshold (R-Stitch's tau, R2R's tau)
        (lambda v: v**4, 0.5),  # rises with it (CITER's tau, RandomRouting's p)
        (lambda v: math.exp(-v), 0.1),  # beyond the first upper bound: widened (an entropy in nats)
        (lambda v: min(1.0, max(0.0, (0.5 - v) / 0.45)), 0.3),  # flat at both ends (R-Stitch on the packaged pair)
        (lambda v: 1.0 if v < 0.37 else 0.0, 0.5),  # a step: the closest run is kept
    ],
)
def test_the_bisection_brackets_the_target_and_closes_in(share, target):
    value, runs = _search(share, target)
    assert [r["threshold"] for r in runs[:2]] == [0.0, 1.0]  # the bounds first
    assert len(runs) <= 8
    best = min(abs(r["large_fraction"] - target) for r in runs)
    assert abs(share(value) - target) == best
    if share(0.37) != 0.0:  # smooth: within the tolerance
        assert abs(share(value) - target) <= 0.02, runs


def test_the_bisection_says_when_the_target_is_out_of_reach():
    with pytest.raises(CalibrationError, match=r"tau=0 and tau=1 both realise a large share of 0.400"):
        _search(lambda v: 0.4, 0.3)
    with pytest.raises(
        CalibrationError,
        match=r"no tau in \[0, 1\] realises a large share of 0.1 \(the runs realised "
        r"0.200 to 0.700\)",
    ):
        _search(lambda v: 0.2 + 0.5 * v, 0.1)


def test_a_policy_is_calibrated_in_the_engine(pair, tok):
    prompts = mixed_prompts(8, seed=3)
    with Router(pair, tokenizer=tok, processes=False) as r:
        cal = calibrate_large_share(
            r, RandomRouting, prompts, 0.3, param="p", max_new_tokens=16, tol=0.03, concurrency=8
        )
    assert cal.param == "p" and cal.n_prompts == 8 and cal.target == 0.3
    assert cal.within_tol and abs(cal.large_fraction - 0.3) <= 0.03, cal.rounds
    assert cal.rounds[0]["threshold"] == 0.0 and cal.rounds[0]["large_fraction"] == 0.0
    assert cal.rounds[1]["threshold"] == 1.0 and cal.rounds[1]["large_fraction"] > 0.5
    assert all(0 < r["tokens"] <= 8 * 16 and r["failed"] == 0 for r in cal.rounds)
    with pytest.raises(ValueError, match=r"target_large_share must be in \(0, 1\)"):
        calibrate_large_share(None, RandomRouting, prompts, 1.2, param="p")
    with pytest.raises(TypeError, match="a Policy class needs param="):
        calibrate_large_share(None, RandomRouting, prompts, 0.3)


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "twelve.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"q{i}", "question": f"{i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(12))
    )
    return path


def test_a_sweep_calibrates_each_point_on_held_out_questions(pair, tok, questions, tmp_path):
    with Router(pair, tokenizer=tok, processes=False) as r:
        res = evaluate_policy(
            r,
            "random",
            target_large_share=[0.25, 0.5],
            dataset=str(questions),
            limit=4,
            seed=None,
            calibration=6,
            references=["large_only", "small_only"],
            repeats=1,
            max_new_tokens=12,
            concurrency=4,
            progress=False,
            out_dir=tmp_path,
        )
    swept = [x for x in res.records if x["kind"] == "sweep"]
    assert [x["target_large_share"] for x in swept] == [0.25, 0.5]
    for x in swept:
        cal = x["calibration"]
        assert (
            x["value"] == cal["threshold"]
            and x["label"] == f"RandomRouting(p={cal['threshold']:g}, target={x['target_large_share']:g})"
        )
        assert cal["n_prompts"] == 6 and abs(cal["large_fraction"] - x["target_large_share"]) <= cal["tol"]
        assert x["large_fraction"] is not None  # the share realised on the evaluated questions, beside the target
    c = res.config["calibration"]
    assert c["ids"] == [f"q{i}" for i in range(4, 10)]  # the next questions after the evaluated ones
    assert not set(c["ids"]) & set(res.config["dataset"]["ids"])
    head = next(line for line in res.table().splitlines() if "large_frac" in line.split()).split()
    assert head[head.index("large_frac") + 1] == "target"
    assert sum(n.startswith("calibrated: RandomRouting(p=") for n in res.notes()) == 2
    assert "target_large_share" in (tmp_path / "results.csv").read_text().splitlines()[0]


def test_the_cli_takes_target_shares():
    import argparse

    from tokenrouter_sdk.cli.eval import add_arguments

    p = add_arguments(argparse.ArgumentParser())
    args = p.parse_args(["--target-large-share", "0.1,0.3", "--calibration", "16"])
    assert args.target_large_share == [0.1, 0.3] and args.calibration == 16
    assert p.parse_args([]).target_large_share is None
    for bad in ("1.5", "x", "0"):
        with pytest.raises(SystemExit):
            p.parse_args(["--target-large-share", bad])


def test_several_policies_are_each_calibrated_on_the_same_held_out_questions(pair, tok, questions):
    from tokenrouter_sdk.eval import evaluate_policies

    with Router(pair, tokenizer=tok, processes=False) as r:
        res = evaluate_policies(
            r,
            {"a": "random", "b": (lambda p: RandomRouting(p=p, seed=7), [0.5], "p")},
            target_large_share=0.4,
            dataset=str(questions),
            limit=4,
            seed=None,
            calibration=6,
            references=False,
            repeats=1,
            max_new_tokens=12,
            concurrency=4,
            progress=False,
        )
    swept = {x["policy_name"]: x for x in res.records}
    assert set(swept) == {"a", "b"} and all(x["target_large_share"] == 0.4 for x in swept.values())
    assert swept["a"]["value"] != swept["b"]["value"]  # each its own threshold (other draws)
    assert set(res.config["calibration"]["policies"]) == {"a", "b"}
