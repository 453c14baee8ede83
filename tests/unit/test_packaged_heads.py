"""The heads packaged for `Router.default()`'s pair: files, records, the defaults the learned
policies take from them, and the error a head for another hidden size gives."""

import json
from pathlib import Path

import cloudpickle
import pytest
import tomllib
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.policies import CITER, R2R, CoLLM, QueryRouter
from tokenrouter_sdk.policies.heads import load_head, packaged_head_path
from tokenrouter_sdk.train.data import HELDOUT_IDS

from ..helpers import mixed_prompts

KINDS = [("citer", CITER, "tau"), ("r2r", R2R, "tau"), ("co_llm", CoLLM, "eta"), ("query", QueryRouter, "threshold")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind,cls,key", KINDS, ids=[k[0] for k in KINDS])
def test_packaged_head_and_its_record(kind, cls, key):
    path = packaged_head_path(kind)
    assert path.parent == ROOT / "tokenrouter_sdk" / "assets" and path.exists() and path.stat().st_size < 4_000_000
    sd, cfg, meta = load_head(path, kind)
    record = json.loads(path.with_suffix(".json").read_text())
    assert all(v.dtype == torch.float16 for v in sd.values() if v.is_floating_point())
    assert record["kind"] == kind and record["stored_dtype"] == "float16" and record["seed"] == 0
    assert record["command"].startswith(f"tokenrouter train {kind} ") and "--package" in record["command"]
    assert {"python", "torch", "transformers"} <= set(record["versions"])
    ids = record["data"]["train_ids"] + record["data"]["val_ids"]
    assert len(ids) >= 32 and not set(ids) & HELDOUT_IDS  # never trained on the held-out questions
    assert record["models"]["small"]["hidden_size"] == 576 and record["metrics"]
    dt = record["default_threshold"]
    assert 0.2 <= dt["target_large_fraction"] <= 0.8 and cfg["threshold"] == dt["value"]
    held = record["heldout"]  # measured by evals/quality/policy_table.py
    assert held["n"] >= 64 and abs(held["large_fraction"] - dt["target_large_fraction"]) <= 0.1
    assert 0 <= held["agreement"] <= 1
    assert abs(held["random"]["large_fraction"] - held["large_fraction"]) <= 0.03
    pol = cls()  # no arguments: the packaged head
    assert getattr(pol, key) == pytest.approx(cfg["threshold"])
    assert (pol._head.config["hidden_size"] if kind == "query" else pol.hidden_size) == 576


def test_package_data_ships_the_heads():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tokenrouter_sdk"]
    assert "assets/*.pt" in data and "assets/*.json" in data


def test_packaged_r2r_reads_its_token_table_where_it_routes():
    pol = R2R()
    assert pol._emb is None and pol._emb_source == "smollm2-135m-instruct"
    pol._emb = torch.zeros(49152, 576)  # as after its first step
    back = cloudpickle.loads(cloudpickle.dumps(pol))  # what goes to a sub-server process
    assert back._emb is None and back._emb_source == "smollm2-135m-instruct" and back.tau == pol.tau


def test_packaged_heads_on_another_pair_fail_naming_the_fix(pair, tok):
    with Router(pair, tokenizer=tok, processes=False) as r:  # tiny models: hidden size 64
        for kind, cls, _ in KINDS:
            out = r.generate(mixed_prompts(1), policy=cls(), max_new_tokens=4)[0]
            assert out.finish_reason == "failed"
            assert "expects hidden size 576" in out.error and "have size 64" in out.error
            assert f"tokenrouter train {kind}" in out.error and f"train_{kind}(router)" in out.error
