"""Choosing an engine's runner per model (``ModelSpec(source, runner=...)``, ``--runner``): bad
settings fail with an error that names the fix, a missing engine names the extra to install, and
a model the engine loads where its runner is built is planned with the loaded ones, its weights
taken off the memory left. These need no engine installed."""

import importlib.util

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.backends.vllm_runner import VLLMRunnerSpec
from tokenrouter_sdk.cli.common import add_model_arguments, model_specs
from tokenrouter_sdk.kv_sizing import CPU_SHARE, kv_bytes_per_token, plan
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer
from tokenrouter_sdk.placement import ModelSpec
from tokenrouter_sdk.policies import RandomRouting


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-choice")
    tiny_model(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, dtype=torch.float32).save_pretrained(root)
    tiny_tokenizer().save_pretrained(root)
    return str(root)


def test_model_spec_checks_the_runner_and_its_engine_args():
    assert ModelSpec("x").runner == "torch"
    assert ModelSpec.of({"source": "x", "runner": "vllm", "engine_args": {"quantization": "awq"}}) == ModelSpec(
        "x", runner="vllm", engine_args={"quantization": "awq"}
    )
    with pytest.raises(ValueError, match="runner must be one of"):
        ModelSpec("x", runner="tensorrt")
    with pytest.raises(ValueError, match="torch runner takes none"):
        ModelSpec("x", engine_args={"quantization": "awq"})


def test_a_missing_engine_names_the_extra_before_anything_loads(folder, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"pip install 'tokenrouter-sdk\[vllm\]'"):
        Router({"small": ModelSpec(folder), "large": ModelSpec(folder, runner="vllm")}, RandomRouting())


def test_block_size_and_engine_args_the_runner_cannot_take():
    with pytest.raises(ValueError, match="multiple of 16"):
        VLLMRunnerSpec("x", block_size=24)
    with pytest.raises(ValueError, match=r"engine_args may not set \['block_size'\]"):
        VLLMRunnerSpec("x", engine_args={"block_size": 32})


def test_an_engine_model_is_planned_with_the_loaded_ones_its_weights_taken_off(folder):
    loaded = tiny_model(num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2, dtype=torch.float32)
    spec = VLLMRunnerSpec(folder, dtype="bfloat16")
    per = {"small": kv_bytes_per_token(loaded), "large": 2 * 2 * 2 * 32 * 2}  # K and V, 2 layers, 2 heads, dim 32, bf16
    assert spec.kv_bytes_per_token() == per["large"] and spec.dtype_of() == torch.bfloat16
    assert spec.weights_bytes() > 0
    left = 1 << 30
    sizing = plan({"small": loaded, "large": spec}, block_size=16, probe=lambda dev: left)
    tokens = int(CPU_SHARE * (left - spec.weights_bytes())) // sum(per.values())
    want = min(tokens - tokens % 16, 65536)
    assert sizing["small"].tokens == sizing["large"].tokens == want
    assert sizing["large"].kv_bytes_per_token == per["large"] and sizing["large"].shared_with == ("small", "large")
    assert plan({"large": spec}, block_size=16, max_kv_tokens=100)["large"].tokens == 112


def test_the_runner_flag_per_model_and_for_all():
    import argparse

    p = add_model_arguments(argparse.ArgumentParser())
    specs = model_specs(p.parse_args(["--model", "small=a", "--model", "large=b", "--runner", "large=vllm"]), "t")
    assert {n: s.runner for n, s in specs.items()} == {"small": "torch", "large": "vllm"}
    specs = model_specs(p.parse_args(["--model", "small=a", "--model", "large=b", "--runner", "vllm"]), "t")
    assert {s.runner for s in specs.values()} == {"vllm"}
    with pytest.raises(SystemExit, match="--runner: ModelSpec.runner must be one of"):
        model_specs(p.parse_args(["--model", "small=a", "--runner", "small=onnx"]), "t")
    with pytest.raises(SystemExit, match="not models of --model"):
        model_specs(p.parse_args(["--model", "small=a", "--runner", "big=vllm"]), "t")


def test_sglang_names_what_it_needs(folder, monkeypatch):
    from tokenrouter_sdk.backends import sglang_runner

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"runner='sglang' needs SGLang.*pip install 'sglang"):
        Router({"small": ModelSpec(folder), "large": ModelSpec(folder, runner="sglang")}, RandomRouting())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else real(name, *a))
    assert "sgl_kernel built from source" in sglang_runner.sglang_missing(torch.device("cpu"))
    assert sglang_runner.sglang_missing(torch.device("cuda")) is None
