"""Bad input gets an OpenAI-style error ``{"error": {"message", "type", "param", "code"}}`` with
a 4xx status naming the field and the fix, and never touches other requests: a long request
streaming meanwhile gets its whole output. A policy that raises fails its own request with a
500 naming the policy; a dead sub-server turns /health to 503."""

import json
import threading

import httpx
import pytest

from tokenrouter_sdk import Policy, Router
from tokenrouter_sdk.models import tiny_tokenizer
from tokenrouter_sdk.policies.registry import builtin_registry

from ..helpers import ScriptedRunner, StayOn, pools_free
from .conftest import serving

TOKENS = list(range(65, 91))


class Boom(Policy):
    """Raises on its fourth step (position 3)."""

    def route(self, step):
        if step.position >= 3:
            raise RuntimeError("boom at position 3")
        return step.model


class BoomAtOnce(Policy):
    def route(self, step):
        raise RuntimeError("boom at the first step")


@pytest.fixture(scope="module")
def server():
    tok = tiny_tokenizer()
    pair = {
        "small": ScriptedRunner(lambda p: TOKENS[p % 26], max_context=256),
        "large": ScriptedRunner(lambda p: TOKENS[(p + 3) % 26], max_context=256),
    }
    router = Router(pair, StayOn("small"), tokenizer=tok)
    registry = builtin_registry()
    registry.add("boom", Boom)
    registry.add("boom_at_once", BoomAtOnce)
    initial = pools_free(router)
    with serving(router, registry=registry) as (url, app):
        yield router, url, pair, initial


def post(url, body, path="/v1/completions", **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30, **kw)


def check(resp, status, param, *words):
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err["message"])
    assert err["type"] == ("invalid_request_error" if status in (400, 413) else err["type"])
    return err


OK = {"prompt": "hi", "max_tokens": 4, "temperature": 0}

CASES = [
    # (name, body, path, status, param, words in the message)
    ("malformed_json", b'{"prompt": "hi", ', "/v1/completions", 400, None, ["not valid JSON", "line 1"]),
    ("not_an_object", b'["hi"]', "/v1/completions", 400, None, ["JSON object"]),
    ("empty_body", b"", "/v1/completions", 400, None, ["empty"]),
    ("max_tokens_zero", OK | {"max_tokens": 0}, "/v1/completions", 400, "max_tokens", ["at least 1"]),
    ("max_tokens_negative", OK | {"max_tokens": -5}, "/v1/completions", 400, "max_tokens", ["at least 1"]),
    (
        "max_tokens_beyond_context",
        OK | {"max_tokens": 1000},
        "/v1/completions",
        400,
        "max_tokens",
        ["context of 256", "at most 254"],
    ),
    ("max_tokens_not_int", OK | {"max_tokens": "many"}, "/v1/completions", 400, "max_tokens", ["integer"]),
    ("negative_temperature", OK | {"temperature": -0.5}, "/v1/completions", 400, "temperature", [">= 0"]),
    ("top_p_zero", OK | {"top_p": 0}, "/v1/completions", 400, "top_p", ["(0, 1]"]),
    ("top_p_above_one", OK | {"top_p": 1.5}, "/v1/completions", 400, "top_p", ["(0, 1]"]),
    ("top_k_negative", OK | {"top_k": -3}, "/v1/completions", 400, "top_k", [">= 0"]),
    ("empty_prompt", OK | {"prompt": ""}, "/v1/completions", 400, "prompt", ["empty"]),
    ("empty_prompt_list", OK | {"prompt": []}, "/v1/completions", 400, "prompt", ["empty"]),
    ("missing_prompt", {"max_tokens": 4}, "/v1/completions", 400, "prompt", ["required"]),
    (
        "prompt_too_long",
        OK | {"prompt": "x" * 300},
        "/v1/completions",
        400,
        "prompt",
        ["300 tokens", "context is 256", "at most 255"],
    ),
    ("token_out_of_vocab", OK | {"prompt": [5, 99999]}, "/v1/completions", 400, "prompt", ["99999", "vocabulary"]),
    ("unknown_model", OK | {"model": "gpt-4"}, "/v1/completions", 404, "model", ["gpt-4", "/v1/models"]),
    ("unknown_policy", OK | {"policy": "fastest"}, "/v1/completions", 400, "policy", ["fastest", "rstitch"]),
    ("bad_policy_argument", OK | {"policy": "rstitch:tau=high"}, "/v1/completions", 400, "policy", ["tau", "float"]),
    ("unknown_policy_argument", OK | {"policy": "random:q=1"}, "/v1/completions", 400, "policy", ["'q'", "p, seed"]),
    (
        "policy_file_argument",
        OK | {"policy": "citer:head=/etc/passwd"},
        "/v1/completions",
        400,
        "policy",
        ["head", "per request"],
    ),
    (
        "policy_with_sub_model",
        OK | {"model": "small", "policy": "rstitch"},
        "/v1/completions",
        400,
        "policy",
        ["tokenrouter"],
    ),
    ("n_zero", OK | {"n": 0}, "/v1/completions", 400, "n", ["at least 1"]),
    ("logprobs", OK | {"logprobs": 21}, "/v1/completions", 400, "logprobs", ["[0, 20]"]),
    ("echo_stream", OK | {"echo": True, "stream": True}, "/v1/completions", 400, "echo", ["not supported"]),
    ("empty_stop", OK | {"stop": ["x", ""]}, "/v1/completions", 400, "stop", ["non-empty"]),
    ("chat_no_messages", {"messages": [], "max_tokens": 4}, "/v1/chat/completions", 400, "messages", ["empty"]),
    ("chat_bad_message", {"messages": [{"content": "hi"}]}, "/v1/chat/completions", 400, "messages", ["required"]),
    (
        "chat_image_part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "/v1/chat/completions",
        400,
        "messages.0.content",
        ["text parts"],
    ),
    (
        "chat_top_logprobs",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "/v1/chat/completions",
        400,
        "top_logprobs",
        ["logprobs: true"],
    ),
    (
        "chat_max_completion_tokens",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        "/v1/chat/completions",
        400,
        "max_completion_tokens",
        ["at least 1"],
    ),
]


def test_bad_inputs_never_touch_other_requests(server):
    router, url, pair, initial = server
    pair["small"].delay_s = 0.01
    result = {}

    def long_request():
        result["resp"] = post(
            url, {"prompt": "keep going", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": False}
        )

    t = threading.Thread(target=long_request)
    t.start()
    try:
        errors = {}
        for name, body, path, status, param, words in CASES:
            errors[name] = check(post(url, body, path), status, param, *words)
        # 10 MB body: refused by size (Content-Length) before parsing
        big = b'{"prompt": "' + b"x" * (10 * 1024 * 1024) + b'"}'
        check(post(url, big), 413, None, "limit", "bytes")
        # streamed bad input gets the same JSON error, not an event stream
        check(post(url, OK | {"stream": True, "max_tokens": 0}), 400, "max_tokens", "at least 1")
        # unknown fields are ignored, as OpenAI does
        ok = post(url, OK | {"frobnicate": 3, "metadata": {"a": 1}})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "CDEF"
        # unknown route and wrong method: the same error shape
        check(httpx.get(url + "/v1/nothing"), 404, None, "/v1/nothing")
        check(httpx.get(url + "/v1/completions"), 405, None, "GET")
    finally:
        t.join(60)
        pair["small"].delay_s = 0.0
    resp = result["resp"]
    assert resp.status_code == 200
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 200 and len(body["choices"][0]["text"]) == 200
    assert body["tokenrouter"]["finish_reason"] == "length"
    assert pools_free(router) == initial


def test_chunked_body_over_the_limit_is_refused(server):
    """Without a Content-Length header the body is refused as soon as it passes the limit."""
    router, url, pair, initial = server

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    resp = httpx.post(
        url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30
    )
    check(resp, 413, None, "limit")


@pytest.mark.parametrize("stream", [False, True])
def test_policy_that_raises_fails_its_own_request(server, stream):
    router, url, pair, initial = server
    other = {}
    t = threading.Thread(target=lambda: other.setdefault("r", post(url, OK | {"max_tokens": 30, "ignore_eos": True})))
    t.start()
    resp = post(url, OK | {"max_tokens": 20, "ignore_eos": True, "policy": "boom_at_once", "stream": stream})
    err = check(resp, 500, None, "Boom", "boom at the first step")
    assert err["type"] == "server_error" and err["code"] == "policy_error"
    t.join(30)
    assert other["r"].status_code == 200 and other["r"].json()["usage"]["completion_tokens"] == 30
    if stream:
        # raising after the first tokens were sent (a step takes 50 ms, so the first token goes out
        # alone): the stream ends with an error event naming the policy
        pair["small"].delay_s = 0.05
        try:
            with httpx.stream(
                "POST",
                url + "/v1/completions",
                json=OK | {"max_tokens": 20, "ignore_eos": True, "policy": "boom", "stream": True},
            ) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        finally:
            pair["small"].delay_s = 0.0
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert "Boom" in last["error"]["message"] and "position 3" in last["error"]["message"]
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
        assert text == "CDE"
    else:
        err = check(post(url, OK | {"max_tokens": 20, "ignore_eos": True, "policy": "boom"}), 500, None, "Boom")
    assert pools_free(router) == initial


class Dying(ScriptedRunner):
    def forward(self, seqs):
        raise SystemExit("the large model's worker died")


def test_health_is_503_when_a_sub_server_is_dead():
    tok = tiny_tokenizer()
    pair = {"small": ScriptedRunner(lambda p: 70), "large": Dying(lambda p: 71)}
    with Router(pair, StayOn("small"), tokenizer=tok) as router, serving(router) as (url, _):
        assert httpx.get(url + "/health").status_code == 200
        resp = post(url, OK | {"model": "large"})
        assert resp.status_code == 500 and "'large'" in resp.json()["error"]["message"]
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "unavailable"
        assert h.json()["models"]["large"]["alive"] is False and h.json()["models"]["small"]["alive"] is True
        resp = post(url, OK)
        assert resp.status_code == 503 and "'large'" in resp.json()["error"]["message"]


def test_health_counts_a_busy_sub_server_as_answering(monkeypatch):
    """A sub-server answers KV queries between steps: one that misses the wait but stepped
    recently is busy (200); one silent for longer than the grace period is not (503)."""
    tok = tiny_tokenizer()
    pair = {"small": ScriptedRunner(lambda p: 70), "large": ScriptedRunner(lambda p: 71)}
    with Router(pair, StayOn("small"), tokenizer=tok) as router, serving(router) as (url, app):
        assert post(url, OK | {"policy": "large_only"}).status_code == 200  # both models stepped
        post(url, OK)

        def slow(timeout=10.0):
            raise TimeoutError("sub-server(s) ['large'] did not report KV stats within 5.0 s")

        monkeypatch.setattr(router, "kv_stats", slow)
        h = httpx.get(url + "/health")
        assert h.status_code == 200 and h.json()["models"]["large"]["busy"] is True
        metrics = app.state.tr.metrics
        monkeypatch.setitem(metrics._last_step, "large", metrics._last_step["large"] - 3600)
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and h.json()["models"]["large"]["alive"] is False
        assert h.json()["models"]["small"]["alive"] is True and "did not report" in h.json()["error"]["message"]
