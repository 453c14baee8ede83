"""The HTTP server over two models that do not share a tokenizer (the two toy tokenizers of
tests/helpers.py): /v1/completions and /v1/chat/completions answer what `Router.generate` gives
for the same text and seed (each model reads the prompt in its own vocabulary and chat template),
streamed or not; what only one vocabulary can mean (token-id prompts, stop token ids, logprobs)
is a 400 naming the field."""

import json

import httpx
import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.policies import RandomRouting

from ..helpers import byte_level_toy, pools_free, sentencepiece_toy, toy_lm
from .conftest import serving

PROMPT = "the rain 你好"
MESSAGES = [{"role": "user", "content": "the rain"}]


@pytest.fixture(scope="module")
def served():
    ta, tb = byte_level_toy(), sentencepiece_toy()
    router = Router(
        {"small": (toy_lm(ta, 1), ta), "large": (toy_lm(tb, 2, arch="qwen2"), tb)}, RandomRouting(p=0.4, seed=5)
    )
    with serving(router) as (url, _app):
        yield router, url
    router.close()


def post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


def test_a_completion_equals_generate(served):
    router, url = served
    r = post(
        url,
        "/v1/completions",
        {"model": "tokenrouter", "prompt": PROMPT, "max_tokens": 20, "temperature": 0.9, "seed": 3},
    )
    assert r.status_code == 200, r.text
    ref = router.generate(PROMPT, chat=False, max_new_tokens=20, temperature=0.9, seed=3)
    body = r.json()
    assert body["choices"][0]["text"] == ref.text and ref.hops > 0
    assert body["choices"][0]["finish_reason"] == ("length" if ref.finish_reason == "length" else "stop")


def test_a_streamed_chat_completion_equals_generate(served):
    router, url = served
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": "tokenrouter",
            "messages": MESSAGES,
            "max_tokens": 16,
            "temperature": 0.9,
            "seed": 4,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200
        text = ""
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    ref = router.generate(MESSAGES, max_new_tokens=16, temperature=0.9, seed=4)
    assert text == ref.text
    assert all(f == u for f, u in pools_free(router).values())


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": [5, 6, 7]}, "prompt"),
        ({"prompt": PROMPT, "stop_token_ids": [2]}, "stop_token_ids"),
        ({"prompt": PROMPT, "logprobs": 2}, "logprobs"),
    ],
)
def test_what_one_vocabulary_means_is_a_400(served, body, param):
    _, url = served
    r = post(url, "/v1/completions", {"model": "tokenrouter", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "tokenizer" in err["message"]
