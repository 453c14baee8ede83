"""End to end on the packaged pair (SmolLM2-135M-Instruct and its self-draft), sub-servers in
processes: ``tokenrouter serve`` as a subprocess, the real `openai` client, a client that hangs
up, and lm-evaluation-harness on a local eight-question task through the HTTP model types
(``local-completions``, ``local-chat-completions``) and the in-process ``tokenrouter`` type."""

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from .lm_eval_task import write_task

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")

POLICY = "rstitch:tau=0.1"
MESSAGES = [{"role": "user", "content": "What is 7 + 5?"}]


@pytest.fixture(scope="module")
def cli_server():
    env = dict(os.environ, TOKENROUTER_PROCESSES="1", TQDM_DISABLE="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenrouter_sdk.cli",
            "serve",
            "--port",
            "0",
            "--policy",
            POLICY,
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    try:
        deadline = time.monotonic() + 300
        url = None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            lines.append(line)
            m = re.search(r"tokenrouter serve: (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, f"the server did not start: {''.join(lines)}"
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def lm():
    """The in-process lm-eval model, built as ``--model tokenrouter --model_args ...`` builds it."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model

    from tokenrouter_sdk.eval.lm_eval_model import TokenRouterLM

    cls = get_model("tokenrouter")
    assert cls is TokenRouterLM
    model = cls.create_from_arg_string("policy=rstitch,tau=0.1,concurrency=8,processes=True")
    yield model
    model.close()


def test_openai_client_on_the_packaged_pair(cli_server, lm):
    client = openai.OpenAI(base_url=cli_server + "/v1", api_key="unused", max_retries=0, timeout=300)
    resp = client.chat.completions.create(model="tokenrouter", messages=MESSAGES, max_tokens=32, temperature=0)
    text = resp.choices[0].message.content
    assert "12" in text
    ref = lm.router.generate(MESSAGES, max_new_tokens=32, temperature=0)
    ext = resp.model_extra["tokenrouter"]
    assert text == ref.text and ext["writers"] == ref.token_models
    assert ext["hops"] == ref.hops and set(ext["writers"]) == {"small", "large"}
    chunks = list(
        client.chat.completions.create(
            model="tokenrouter", messages=MESSAGES, max_tokens=32, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].model_extra["tokenrouter"]["writers"] == ext["writers"]

    # a client that hangs up mid-stream: the request is aborted and both pools are free again
    body = {
        "prompt": "Write a long story about the sea.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=120) as c, c.stream("POST", cli_server + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    deadline = time.monotonic() + 30
    while True:
        h = httpx.get(cli_server + "/health", timeout=30).json()
        if all(m["free_blocks"] == m["num_blocks"] and m["owned"] == m["pending"] == 0 for m in h["models"].values()):
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.2)
    metrics = httpx.get(cli_server + "/metrics").text
    assert re.search(r'tokenrouter_requests_finished_total\{finish_reason="aborted"\} 1\.0', metrics), metrics


def _samples(res):
    return [s["resps"][0][0] for s in sorted(res["samples"]["arith8"], key=lambda s: s["doc_id"])]


def test_lm_eval_over_http_and_in_process(cli_server, lm, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = TaskManager(
        include_path=str(write_task(tmp_path / "task")), include_defaults=False
    )  # no index of every bundled task
    common = dict(tasks=["arith8"], task_manager=tasks, apply_chat_template=True, log_samples=True)
    local = lm_eval.simple_evaluate(model=lm, **common)
    http = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": cli_server + "/v1/completions",
            "model": "tokenrouter",
            "num_concurrent": 8,
            "max_retries": 1,
            "tokenized_requests": False,
        },
        **common,
    )
    chat = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={
            "base_url": cli_server + "/v1/chat/completions",
            "model": "tokenrouter",
            "num_concurrent": 8,
            "max_retries": 1,
            "tokenizer_backend": None,
        },
        **common,
    )
    scores = [r["results"]["arith8"]["exact_match,last_number"] for r in (local, http, chat)]
    assert all(len(r["samples"]["arith8"]) == 8 for r in (local, http, chat))
    assert all(0.25 <= s <= 1.0 for s in scores), scores
    # greedy, same policy, same rendered prompts: the same answers in-process and over HTTP
    same = [a == b == c for a, b, c in zip(_samples(local), _samples(http), _samples(chat))]
    assert sum(same) >= 6, (_samples(local), _samples(http), _samples(chat))
    routing = local["config"]["tokenrouter"]
    assert routing["requests"] == 8 and routing["failed"] == 0 and routing["committed_tokens"] > 8
    assert 0 < routing["large_fraction"] < 1 and routing["hop_rate"] > 0 and routing["committed_tok_s"] > 0
    json.dumps(local["config"]["tokenrouter"])  # lands in the results file as plain JSON
