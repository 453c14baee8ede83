"""Log-probabilities, ``n`` and ``chat_template_kwargs`` over HTTP (completions and chat, streamed
and not), equal to what the Router gives in-process; ``echo`` + ``logprobs`` scores the prompt by
teacher forcing; and lm-evaluation-harness's multiple-choice (log-likelihood) tasks from a local
YAML and JSONL, through the in-process ``tokenrouter`` model and through the server."""

import json

import httpx
import pytest

from tests.helpers import thinking_tokenizer
from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_model, truncate
from tokenrouter_sdk.policies import RandomRouting

from .lm_eval_task import write_choice_task

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Name a planet."}]


@pytest.fixture(scope="module")
def served():
    large = tiny_model(num_layers=4, seed=1)
    router = Router(
        {"small": truncate(large, 2), "large": large}, RandomRouting(p=0.4, seed=5), tokenizer=thinking_tokenizer()
    )
    url = router.serve()
    yield router, url
    router.close()


def post(url, path, body, status=200):
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_completion_logprobs_equal_generate(served):
    router, url = served
    body = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2})
    ref = router.generate(PROMPT, chat=False, max_new_tokens=12, logprobs=2)
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-12)
    assert lp["tokens"] == [router.tokenizer.decode([t]) for t in ref.token_ids]
    assert len(lp["top_logprobs"]) == 12 and all(1 <= len(t) <= 2 for t in lp["top_logprobs"])
    by_id = post(
        url,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True},
    )["choices"][0]["logprobs"]
    assert by_id["tokens"] == [f"token_id:{t}" for t in ref.token_ids]  # unique, where texts may collide
    assert by_id["top_logprobs"] == [
        {f"token_id:{t}": pytest.approx(v, abs=1e-12) for t, v in top.items()} for top in ref.top_logprobs
    ]
    assert body["tokenrouter"]["writers"] == ref.token_models and set(ref.token_models) == {"small", "large"}
    streamed = []
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2, "stream": True},
        timeout=120,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                    streamed += chunk["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed == pytest.approx(ref.logprobs, abs=1e-12)


def test_chat_logprobs_and_template_kwargs(served):
    router, url = served
    req = {
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    body = post(url, "/v1/chat/completions", req)
    ref = router.generate(MESSAGES, max_new_tokens=8, logprobs=3, chat_template_kwargs={"enable_thinking": False})
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(ref.logprobs, abs=1e-12)
    assert all(len(c["top_logprobs"]) == 3 for c in content)
    assert body["usage"]["prompt_tokens"] == len(
        router.encode(MESSAGES, chat_template_kwargs={"enable_thinking": False})
    )
    assert body["usage"]["prompt_tokens"] == len(router.encode(MESSAGES)) + len("<think>\n\n</think>\n\n")
    assert body["choices"][0]["message"]["content"] == ref.text
    ids = post(url, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}})["tokens"]
    assert ids == router.encode(MESSAGES, chat_template_kwargs={"enable_thinking": False})
    no = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "temperature": 0})
    assert no["choices"][0]["logprobs"] is None and no["usage"]["prompt_tokens"] == len(router.encode(MESSAGES))


def test_echo_logprobs_score_the_prompt_by_teacher_forcing(served):
    router, url = served
    ids = router.encode(PROMPT, chat=False)
    body = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True})
    lp = body["choices"][0]["logprobs"]
    assert (
        len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    )
    scored = router.score([ids[:1]], [ids[1:]])[0]  # the same tokens, the same key: routed the same
    assert lp["token_logprobs"][1:-1] == pytest.approx(scored.logprobs, abs=1e-12)
    assert body["tokenrouter"]["writers"][:-1] == scored.token_models
    assert body["choices"][0]["text"].startswith(PROMPT)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
    only = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "logprobs": 0, "echo": True})
    assert only["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(scored.logprobs, abs=1e-12)
    assert only["choices"][0]["text"] == PROMPT


def test_n_choices_with_their_own_samples(served):
    _, url = served
    body = post(
        url, "/v1/completions", {"prompt": [PROMPT, "Hello"], "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 2}
    )
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert len({c["text"] for c in body["choices"][:3]}) == 3
    assert len(body["tokenrouter"]["choices"]) == 6 and body["usage"]["completion_tokens"] == 48


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ({"prompt": PROMPT, "echo": True, "stream": True}, "echo"),
        ({"prompt": PROMPT, "echo": True, "logprobs": 1, "stop": ["x"]}, "stop"),
        ({"prompt": PROMPT, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        ({"prompt": PROMPT, "n": 0}, "n"),
    ],
)
def test_bad_logprob_fields_are_400(served, body, param):
    _, url = served
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = post(url, path, body, status=400)["error"]
    assert err["param"] == param, err


def _resps(res):
    return [[r[0] for r in s["resps"]] for s in sorted(res["samples"]["choice4"], key=lambda s: s["doc_id"])]


def test_lm_eval_multiple_choice_in_process_and_over_http(served, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from tokenrouter_sdk.eval.lm_eval_model import TokenRouterLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    router, url = served
    tasks = TaskManager(include_path=str(write_choice_task(tmp_path / "task")), include_defaults=False)
    common = dict(tasks=["choice4"], task_manager=tasks, log_samples=True)
    lm = TokenRouterLM(router=router)
    local = lm_eval.simple_evaluate(model=lm, **common)
    # the context prefilled, the continuation routed: sum(Router.score) of the same tokens
    first = sorted(local["samples"]["choice4"], key=lambda s: s["doc_id"])[0]
    ctx, cont = first["arguments"][0]
    c_ids, full = lm.tok_encode(ctx), lm.tok_encode(ctx + cont)
    ref = router.score([c_ids], [full[len(c_ids) :]])[0]
    assert first["resps"][0][0][0] == pytest.approx(sum(ref.logprobs), abs=1e-9)
    routed = TokenRouterLM(router=router, route_context=True)
    forced = lm_eval.simple_evaluate(model=routed, **common)
    http = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": url + "/v1/completions",
            "model": "tokenrouter",
            "num_concurrent": 4,
            "max_retries": 1,
            "tokenizer_backend": "remote",
        },
        **common,
    )
    for res in (local, forced, http):
        assert len(res["samples"]["choice4"]) == 4 and 0.0 <= res["results"]["choice4"]["acc,none"] <= 1.0
    # over HTTP the server scores echo + logprobs from the first token: as route_context=True does
    for a, b in zip(_resps(forced), _resps(http)):
        assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=1e-9) and [x[1] for x in a] == [
            x[1] for x in b
        ]
    routing = local["config"]["tokenrouter"]
    assert routing["requests"] == 12 and routing["failed"] == 0 and 0 < routing["large_fraction"] < 1
