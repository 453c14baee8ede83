"""A real model with sliding windows: Gemma-3-270M (float32, converted once from the GGUF wheels
on the package registry, `tokenrouter_sdk.models.gemma3_270m_folder`), whose attention
alternates 512-key windows (five layers in six, rotary base 10,000) with full attention (rotary
base 1,000,000), with a prompt of more than 1,024 tokens, so that every generated token attends
past the window: alone, its first 32 tokens equal transformers' own greedy ``generate``; routed
with its own first 9 layers, each of 13 tokens equals a full recomputation by the model that wrote it
and every log-probability that model's log-softmax (float32: within 1e-3).
Skipped, saying why, when the registry cannot be reached and the cache holds no conversion."""

import copy

import pytest
import torch

from tests.helpers import KeepEveryThird
from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.eval.datasets import load_benchmark
from tokenrouter_sdk.models import ModelLoadError, gemma3_270m_folder, load_model, truncate
from tokenrouter_sdk.policies import SingleModel
from tokenrouter_sdk.reference import reference_generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

N_NEW = 32
N_ROUTED = 13  # a hand-off every third position: 4 hops at least; each token's reference recomputes 1,100+ positions


@pytest.fixture(scope="module")
def gemma():
    try:
        folder = gemma3_270m_folder()
    except ModelLoadError as e:
        pytest.skip(f"Gemma-3-270M is not in the cache and the package registry cannot be reached: {e}")
    model, tok = load_model(folder, dtype="float32")
    return model, tok


def long_prompt(tok, min_tokens: int = 1100) -> list[int]:
    """Worked GSM8K solutions as few-shot examples until the prompt passes ``min_tokens``, then
    one more question (file order: the same prompt every run)."""
    rows = load_benchmark("gsm8k", limit=60)
    text, i = "", 0
    while len(tok(text).input_ids) < min_tokens:
        text += f"Question: {rows[i]['question']}\nAnswer: {rows[i]['meta']['solution']}\n\n"
        i += 1
    return tok(text + f"Question: {rows[i]['question']}\nAnswer:").input_ids


def test_alone_equals_transformers_generate_past_the_window(gemma):
    """The first 32 tokens equal transformers' greedy ``generate`` (on an untouched copy: its own
    attention and cache), and each token's log-probability equals the log-softmax of generate's
    logits at that step within float32 rounding (4e-5 measured; attention over the whole prompt
    instead of the window moves the first token already)."""
    model, tok = gemma
    ids = long_prompt(tok)
    assert len(ids) > 1024 and model.config.sliding_window == 512
    pristine = copy.deepcopy(model)
    with torch.inference_mode():
        g = pristine.generate(
            torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    want = g.sequences[0, len(ids) :].tolist()
    want_lp = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(g.scores, want)]
    with Router({"large": model}, SingleModel("large"), tokenizer=tok) as r:
        out = r.generate([ids], sampling=SamplingParams(max_new_tokens=N_NEW, logprobs=0))[0]
        runner = r.engine.runners.get("large")
    assert out.token_ids == want, (out.token_ids, want)
    assert len(want) == N_NEW or out.finish_reason in ("eos", "stop")
    assert out.logprobs == pytest.approx(want_lp, abs=1e-3)
    if runner is not None:
        assert [p.window for p in runner.spec.layers] == [
            512 if t == "sliding_attention" else None for t in model.config.layer_types
        ]


def test_routed_with_its_first_layers_equals_the_reference(gemma):
    model, tok = gemma
    ids = long_prompt(tok)
    models = {"small": truncate(model, 9), "large": model}
    ref = copy.deepcopy(models)
    params = SamplingParams(max_new_tokens=N_ROUTED, ignore_eos=True, logprobs=0)
    with Router(models, KeepEveryThird(), tokenizer=tok) as r:
        out = r.generate([ids], sampling=params)[0]
    got = reference_generate(ref, ids, KeepEveryThird(), params, rid=out.rid, key=out.key)
    assert set(out.token_models) == {"small", "large"} and out.hops >= 4
    assert out.token_ids == got["token_ids"] and out.token_models == got["token_models"]
    assert out.logprobs == pytest.approx(got["logprobs"], abs=1e-3)


def test_a_text_prompt_gets_the_bos_and_reads_as_transformers_generate(gemma):
    """Gemma's tokenizer has no chat template and adds ``<bos>`` to a text; without it the model
    writes garbage. A text prompt is encoded as ``tok(text)`` and its greedy output equals
    transformers' ``generate`` on ``tok(text)``; ``add_special_tokens=False`` drops the BOS."""
    model, tok = gemma
    text = "The capital of France is"
    ids = tok(text).input_ids
    assert not tok.chat_template and ids[0] == tok.bos_token_id
    pristine = copy.deepcopy(model)
    with torch.inference_mode():
        want = pristine.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    with Router({"large": model}, SingleModel("large"), tokenizer=tok) as r:
        assert r.encode(text) == ids and r.encode(text, add_special_tokens=False) == ids[1:]
        out = r.generate(text, max_new_tokens=12)
    assert out.token_ids == want[: len(out.token_ids)] and (len(out.token_ids) == 12 or out.finish_reason == "eos")
    assert "France" in out.text or "Paris" in out.text, out.text
