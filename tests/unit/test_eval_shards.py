"""A sweep spread over shards: each shard runs its share of the points with its own Router, the
merge gives the records of the unsharded sweep (all but timings), in the same order."""

import json

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.eval import evaluate_policy, load_benchmark, merge_sweep
from tokenrouter_sdk.eval.sweep import TIMING_KEYS
from tokenrouter_sdk.policies import RStitch

SAMPLING = dict(max_new_tokens=16, concurrency=4, progress=False, repeats=1)
TIMING = set(TIMING_KEYS)  # timings, and the prefix-cache hits of requests that share a prompt prefix


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    qs = ["2+3?", "7*6?", "10-4?", "9/3?"]
    path = d / "tiny.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "question": q, "answer": "5"}) + "\n" for i, q in enumerate(qs)))
    return load_benchmark(path, template="Q: {question}", seed=None)


def strip(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_two_shards_merged_equal_the_unsharded_sweep(pair, tok, bench, tmp_path):
    values = [0.7, 0.8]  # with large_only and small_only: 4 points, and their matched references
    with Router(pair, tokenizer=tok) as r:
        whole = evaluate_policy(r, RStitch, values, dataset=bench, out_dir=tmp_path / "whole", param="tau", **SAMPLING)
    assert [x["kind"] for x in whole.records][:4] == ["large_only", "small_only", "sweep", "sweep"]
    assert any(x["kind"] == "random" for x in whole.records), "the sweep should have a mixed operating point"
    out = tmp_path / "sharded"
    parts = []
    for i in (1, 2):  # each shard with its own Router, as on separate workers
        with Router(pair, tokenizer=tok) as r:
            parts.append(
                evaluate_policy(r, RStitch, values, dataset=bench, out_dir=out, param="tau", shard=f"{i}/2", **SAMPLING)
            )
    assert [x["label"] for x in parts[0].records][:2] == ["large_only", "RStitch(tau=0.7)"]
    assert [x["label"] for x in parts[1].records][:2] == ["small_only", "RStitch(tau=0.8)"]
    assert not (out / "results.json").exists()  # a shard alone is not the sweep
    merged = merge_sweep(out)
    assert strip(merged.records) == strip(whole.records)
    assert merged.answers == whole.answers
    assert merged.config["shards"] == 2 and merged.config["dataset"] == whole.config["dataset"]
    assert (out / "results.json").exists() and (out / "plot.html").exists()


def test_merge_names_what_is_missing(pair, tok, bench, tmp_path):
    with pytest.raises(FileNotFoundError, match="no shard manifests"):
        merge_sweep(tmp_path)
    with Router(pair, tokenizer=tok) as r:
        evaluate_policy(
            r,
            RStitch,
            [0.8],
            dataset=bench,
            out_dir=tmp_path,
            param="tau",
            shard="2/3",
            references=["large_only"],
            **SAMPLING,
        )
        with pytest.raises(FileNotFoundError, match=r"shard\(s\) \[1, 3\] of 3 have not finished"):
            merge_sweep(tmp_path)
        with pytest.raises(ValueError, match="out_dir"):
            evaluate_policy(r, RStitch, [0.8], dataset=bench, param="tau", shard="1/2", **SAMPLING)
        for bad in ("0/2", "3/2", "x/2", (2, 2)):
            with pytest.raises(ValueError, match="shard"):
                evaluate_policy(r, RStitch, [0.8], dataset=bench, param="tau", shard=bad, out_dir=tmp_path, **SAMPLING)


def test_shards_of_another_sweep_are_refused(pair, tok, bench, tmp_path):
    with Router(pair, tokenizer=tok) as r:
        evaluate_policy(
            r,
            RStitch,
            [0.8],
            dataset=bench,
            out_dir=tmp_path,
            param="tau",
            shard="1/2",
            references=["large_only"],
            **SAMPLING,
        )
        evaluate_policy(
            r,
            RStitch,
            [0.9],
            dataset=bench,
            out_dir=tmp_path,
            param="tau",
            shard="2/2",
            references=["large_only"],
            **SAMPLING,
        )
    with pytest.raises(ValueError, match="different sweeps"):
        merge_sweep(tmp_path)


def test_launch_argv_drops_the_launcher_flags():
    from tokenrouter_sdk.cli.eval import _shard_launch_argv
    from tokenrouter_sdk.cli.main import build_parser
    from tokenrouter_sdk.eval.shards import shard_argv

    argv = ["--values", "0.1,0.2", "--shards", "3", "--launcher=local", "--out", "o", "--limit", "4", "--merge"]
    args = build_parser().parse_args(["eval", *argv])
    args.argv = argv
    assert _shard_launch_argv(args) == ["--values", "0.1,0.2", "--limit", "4"]
    shard = build_parser().parse_args(["eval", *shard_argv(_shard_launch_argv(args), 2, 3, "o")])
    assert (shard.shard, shard.out, shard.values, shard.limit, shard.shards) == ("2/3", "o", [0.1, 0.2], 4, None)
