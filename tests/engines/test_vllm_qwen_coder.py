"""The real Qwen2.5-Coder pair (0.5B / 1.5B, in `pair_dtype`: bfloat16 on a CPU that has it) with
its large model on vLLM's runner: its greedy tokens agree with our runner's on three prompts for 32
tokens, and a routed run over the mixed pair gives every KV block back. Skipped without vLLM, and
where the pair's weights cannot be had (the package registry unreachable and no converted copy
in the cache)."""

import importlib.util

import pytest

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.models import ModelLoadError
from tokenrouter_sdk.placement import ModelSpec
from tokenrouter_sdk.policies import LargeOnly, RStitch

from ..helpers import pools_free

pytestmark = [
    pytest.mark.integration,
    pytest.mark.engines,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: pip install 'tokenrouter-sdk[vllm]' runs this tier",
    ),
]

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What does the SQL keyword JOIN do?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]
N_NEW = 32


@pytest.fixture(scope="module")
def coder_pair():
    from tokenrouter_sdk.pairs import pair_models

    try:
        return pair_models("qwen2.5-coder")
    except ModelLoadError as e:
        pytest.skip(f"the Qwen2.5-Coder pair's weights cannot be had here: {e}")


def _large_alone(models):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with Router(models, LargeOnly(), max_kv_tokens=2048) as r:
        outs = r.generate(PROMPTS, sampling=params, timeout=600)
        assert all(f == n for f, n in pools_free(r).values())
    assert all(o.finish_reason == "length" and set(o.token_models) == {"large"} for o in outs)
    return [o.token_ids for o in outs]


def test_vllm_and_our_runner_agree_on_32_greedy_tokens(coder_pair):
    ours = _large_alone(coder_pair)
    s, lg = coder_pair["small"], coder_pair["large"]
    mixed = {"small": s, "large": ModelSpec(lg.source, device=lg.device, dtype=lg.dtype, runner="vllm")}
    theirs = _large_alone(mixed)
    assert theirs == ours
    with Router(mixed, RStitch(tau=0.3), max_kv_tokens=2048) as r:
        outs = r.generate(PROMPTS, max_new_tokens=N_NEW, concurrency=3, timeout=600)
        assert all(o.ok for o in outs), [o.error for o in outs]
        assert all(f == n for f, n in pools_free(r).values())
