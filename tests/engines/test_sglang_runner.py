"""SGLang's runner behind our seam (`tokenrouter_sdk.backends.sglang_runner`), through the same
checks as vLLM's (tests/engines/test_vllm_runner.py): routed output over a pair on SGLang and a
mixed pair (small on ours) equals the naive reference until its first near-tie, log-probabilities
within 1e-4, every KV block back after a run, an abort and a KV-pressure run. SGLang runs on a
GPU only (its CPU engine needs kernels built from source): skipped without SGLang or CUDA."""

import importlib.util
import time

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.placement import ModelSpec
from tokenrouter_sdk.policies import RandomRouting

from .test_vllm_runner import N_NEW, POLICIES, _all_free, _prompts, check_reference

pytestmark = [
    pytest.mark.engines,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="SGLang is not installed: pip install 'sglang==0.5.23' on a CUDA machine",
    ),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang's runner needs a CUDA GPU"),
]

ENGINE = {"attention_backend": "triton", "mem_fraction_static": 0.3}  # any head size; a small pool


def _spec(folder):
    return ModelSpec(folder, device="cuda", runner="sglang", engine_args=dict(ENGINE))


@pytest.mark.parametrize("mixed", [False, True], ids=["sglang_pair", "small_on_ours"])
def test_routed_sglang_pair_equals_the_reference(tiny_folders, reference_models, mixed):
    folders = tiny_folders["llama"]
    models = {
        "small": ModelSpec(folders["small"]) if mixed else _spec(folders["small"]),
        "large": _spec(folders["large"]),
    }
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, logprobs=0)
    with Router(models, RandomRouting(), max_kv_tokens=1024, processes=False) as r:
        for name, policy in POLICIES.items():
            outs = r.generate(_prompts(), sampling=params, policy=policy(), concurrency=4, timeout=300)
            assert {m for o in outs for m in o.token_models} == {"small", "large"}, name
            check_reference(reference_models["llama"], outs, policy, params)
            _all_free(r)
        call = r.submit([[3, 4, 5]], max_new_tokens=200, ignore_eos=True)
        while len(call[0].output.token_ids) < 5:
            time.sleep(0.002)
        r.abort(call)
        call.wait(30)
        assert call[0].output.finish_reason == "aborted"
        _all_free(r)
