"""A sweep's shards as Ray tasks on a two-node cluster: the driver writes the files the tasks
return and merges them; the records equal the unsharded sweep's (but timings)."""

import json

import pytest

from tokenrouter_sdk.cli.main import main
from tokenrouter_sdk.eval.sweep import TIMING_KEYS

SKIP = set(TIMING_KEYS)  # timings, machine load, and the prefix-cache hits of requests that share a prefix


@pytest.mark.timeout(300)
def test_shards_as_ray_tasks_merge_into_the_sweep(cluster, tmp_path):
    common = [
        "eval",
        "--values",
        "0.3",
        "--limit",
        "2",
        "--max-new-tokens",
        "6",
        "--references",
        "large_only,small_only",
        "--no-progress",
        "--concurrency",
        "2",
        "--pair",
        "smollm2",
        "--small-layers",
        "4",
    ]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    assert main([*common, "--shards", "2", "--launcher", "ray", "--out", str(tmp_path / "ray")]) == 0
    a, b = (json.loads((tmp_path / d / "results.json").read_text())["records"] for d in ("whole", "ray"))
    assert [{k: v for k, v in x.items() if k not in SKIP} for x in a] == [
        {k: v for k, v in x.items() if k not in SKIP} for x in b
    ]
    assert len(list((tmp_path / "ray" / "points").glob("*.json"))) == 3
