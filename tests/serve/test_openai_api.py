"""The real `openai` client against a server on 127.0.0.1 serving the tiny float64 pair:
completions and chat, streamed and not, with the ``tokenrouter`` routing field equal to what
`Router.generate` gives for the same prompt, policy and seed; per-request policies; models,
health, metrics and the tokenizer endpoints; `Router.serve` from a running event loop."""

import asyncio
import threading

import httpx
import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate
from tokenrouter_sdk.policies import LargeOnly, RandomRouting, RStitch

from .conftest import serving

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Name a planet."}]


@pytest.fixture(scope="module")
def tiny():
    large = tiny_model(num_layers=4, seed=1)
    router = Router(
        {"small": truncate(large, 2), "large": large}, RandomRouting(p=0.4, seed=5), tokenizer=tiny_tokenizer()
    )
    url = router.serve()
    yield router, url
    router.close()


@pytest.fixture(scope="module")
def client(tiny):
    return openai.OpenAI(base_url=tiny[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


def ext(obj) -> dict:
    """The ``tokenrouter`` extension field of an openai response or chunk."""
    return obj.model_extra["tokenrouter"]


def metrics(url) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 11)])
def test_completion_equals_generate(tiny, client, temperature, seed):
    router, _ = tiny
    resp = client.completions.create(
        model="tokenrouter", prompt=PROMPT, max_tokens=24, temperature=temperature, seed=seed
    )
    ref = router.generate(PROMPT, chat=False, max_new_tokens=24, temperature=temperature, seed=seed)
    choice = resp.choices[0]
    assert choice.text == ref.text
    assert ext(resp)["writers"] == ref.token_models and len(ref.token_models) == resp.usage.completion_tokens
    assert set(ref.token_models) == {"small", "large"}  # the policy really routes
    assert ext(resp)["hops"] == ref.hops and ext(resp)["discarded"] == ref.discarded
    assert ext(resp)["large_fraction"] == pytest.approx(ref.token_models.count("large") / len(ref.token_models))
    assert ext(resp)["ttft_s"] > 0 and ext(resp)["policy"].startswith("RandomRouting")
    assert resp.usage.prompt_tokens == len(router.encode(PROMPT, chat=False))
    assert choice.finish_reason == {"length": "length", "eos": "stop", "stop": "stop"}[ref.finish_reason]


def test_chat_equals_generate(tiny, client):
    router, _ = tiny
    resp = client.chat.completions.create(
        model="tokenrouter", messages=MESSAGES, max_tokens=20, temperature=0.7, seed=3
    )
    ref = router.generate(MESSAGES, max_new_tokens=20, temperature=0.7, seed=3)
    assert resp.choices[0].message.content == ref.text and resp.choices[0].message.role == "assistant"
    assert ext(resp)["writers"] == ref.token_models
    assert resp.usage.prompt_tokens == len(router.encode(MESSAGES))
    assert resp.usage.completion_tokens == len(ref.token_ids)


@pytest.mark.parametrize("chat", [False, True])
def test_stream_joined_equals_plain(tiny, client, chat):
    kw = dict(model="tokenrouter", max_tokens=32, temperature=1.0, seed=21)
    if chat:
        plain = client.chat.completions.create(messages=MESSAGES, **kw)
        chunks = list(
            client.chat.completions.create(messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kw)
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        want = plain.choices[0].message.content
    else:
        plain = client.completions.create(prompt=PROMPT, **kw)
        chunks = list(
            client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw)
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        want = plain.choices[0].text
    assert text == want and len(chunks) >= 3
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == plain.choices[0].finish_reason
    assert ext(finals[0])["writers"] == ext(plain)["writers"]
    assert finals[0].usage.completion_tokens == plain.usage.completion_tokens
    # the usage chunk (stream_options.include_usage) comes last, with no choices
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # each text chunk names the writers of the tokens it covers, in order
    per_chunk = [w for c in chunks[:-1] if c is not finals[0] for w in ext(c)["writers"]]
    assert per_chunk == ext(plain)["writers"][: len(per_chunk)]


def test_per_request_policy_and_sub_model(tiny, client):
    router, url = tiny
    resp = client.completions.create(
        model="tokenrouter",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"policy": "large_only", "ignore_eos": True},
    )
    assert ext(resp)["writers"] == ["large"] * 12 and ext(resp)["policy"] == "large_only"
    assert (
        resp.choices[0].text
        == router.generate(PROMPT, chat=False, max_new_tokens=12, policy=LargeOnly(), ignore_eos=True).text
    )
    resp = client.completions.create(
        model="small", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ext(resp)["writers"] == ["small"] * 12 and ext(resp)["policy"] == 'single:model="small"'
    spec = {"name": "rstitch", "tau": 0.05}
    resp = client.completions.create(
        model="tokenrouter", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"policy": spec}
    )
    ref = router.generate(PROMPT, chat=False, max_new_tokens=12, policy=RStitch(tau=0.05))
    assert ext(resp)["writers"] == ref.token_models and resp.choices[0].text == ref.text
    resp = client.completions.create(
        model="tokenrouter", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"policy": "random:p=1.0,seed=2"}
    )
    assert ext(resp)["policy"] == "random:p=1.0,seed=2"


def test_several_prompts_in_one_completion(tiny, client):
    router, _ = tiny
    prompts = ["one", "two two", "three three three"]
    resp = client.completions.create(model="tokenrouter", prompt=prompts, max_tokens=8, temperature=0)
    refs = router.generate(prompts, chat=False, max_new_tokens=8)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [r.text for r in refs]
    assert [c["writers"] for c in ext(resp)["choices"]] == [r.token_models for r in refs]
    ids = router.encode("four", chat=False)
    resp = client.completions.create(model="tokenrouter", prompt=ids, max_tokens=8, temperature=0)
    assert resp.choices[0].text == router.generate(ids, max_new_tokens=8).text


def test_models_health_tokenizer(tiny, client):
    router, url = tiny
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tokenrouter", "small", "large"]
    h = httpx.get(url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert set(h.json()["models"]) == {"small", "large"} and all(m["alive"] for m in h.json()["models"].values())
    toks = httpx.post(url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert toks == router.encode(PROMPT, chat=False)
    assert httpx.post(url + "/detokenize", json={"tokens": toks}).json()["prompt"] == PROMPT
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == router.tokenizer.eos_token and info["model_max_length"] == router.max_context


def test_metrics_count_http_and_notebook_requests(tiny, client):
    router, url = tiny
    before = metrics(url)
    resp = client.completions.create(
        model="tokenrouter", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    nb = router.generate(
        "from the notebook", chat=False, max_new_tokens=7, ignore_eos=True
    )  # same engine, same metrics
    after = metrics(url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    tokens = sum(delta("tokenrouter_committed_tokens_total", model=m) for m in ("small", "large"))
    assert tokens == resp.usage.completion_tokens + len(nb.token_ids) == 17
    assert delta("tokenrouter_committed_tokens_total", model="large") == (
        ext(resp)["writers"].count("large") + nb.token_models.count("large")
    )
    assert delta("tokenrouter_requests_finished_total", finish_reason="length") == 2
    assert delta("tokenrouter_hops_total") == ext(resp)["hops"] + nb.hops
    assert delta("tokenrouter_step_seconds_count", model="small") > 0
    total = sum(after[("tokenrouter_committed_tokens_total", (("model", m),))] for m in ("small", "large"))
    assert after[("tokenrouter_large_fraction", ())] == pytest.approx(
        after[("tokenrouter_committed_tokens_total", (("model", "large"),))] / total
    )
    assert after[("tokenrouter_hop_rate", ())] == pytest.approx(after[("tokenrouter_hops_total", ())] / total)
    blocks = router.kv_stats()
    for m in ("small", "large"):
        assert after[("tokenrouter_kv_blocks", (("model", m),))] == blocks[m].num_blocks
        assert after[("tokenrouter_kv_used_blocks", (("model", m),))] == 0  # refreshed at scrape time
    assert after[("tokenrouter_requests_in_flight", ())] == 0


def test_servers_have_their_own_metrics(tiny):
    """Two servers in one process: each registry counts only its own Router's tokens."""
    router, url = tiny
    other = Router({"m": tiny_model(num_layers=1, seed=9)}, tokenizer=tiny_tokenizer())
    try:
        with serving(other) as (url2, _):
            before = metrics(url)
            httpx.post(url2 + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "temperature": 0}, timeout=30)
            m2 = metrics(url2)
            assert m2[("tokenrouter_committed_tokens_total", (("model", "m"),))] == 5
            after = metrics(url)
            committed = [k for k in before if k[0] == "tokenrouter_committed_tokens_total"]
            assert len(committed) == 2 and all(after[k] == before[k] for k in committed)
            assert ("tokenrouter_committed_tokens_total", (("model", "m"),)) not in after
    finally:
        other.close()


def test_router_serve_inside_a_running_loop_and_close():
    """As in Jupyter: serve() is called while an event loop runs in this thread; HTTP and notebook
    requests share the engine; close() stops the server thread and the port."""

    def servers():
        return sum(t.name == "tokenrouter-serve" for t in threading.enumerate())

    n0 = servers()
    large = tiny_model(num_layers=2, seed=3)
    router = Router({"small": truncate(large, 1), "large": large}, RStitch(tau=0.2), tokenizer=tiny_tokenizer())

    async def main():
        url = router.serve(port=0)
        assert router.serve() == url  # a second call returns the running server
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            http, nb = await asyncio.gather(
                c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0}),
                router.agenerate("abc", chat=False, max_new_tokens=6),
            )
        assert http.status_code == 200 and http.json()["choices"][0]["text"] == nb.text
        return url

    url = asyncio.run(main())
    assert servers() == n0 + 1
    router.close()
    assert servers() == n0
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_multi_turn_chats_reuse_the_previous_turns(tiny, client):
    """Each turn's prompt holds the previous turns: they come from the prefix cache, which
    /metrics reports per model."""
    router, url = tiny
    messages = [{"role": "user", "content": "Tell me a story about a fox."}]
    hits, prompts = [], []
    for turn in range(4):
        resp = client.chat.completions.create(model="tokenrouter", messages=messages, max_tokens=16, temperature=0.0)
        prompts.append(resp.usage.prompt_tokens)
        m = metrics(url)
        hits.append(sum(v for (name, labels), v in m.items() if name == "tokenrouter_prefix_cache_hit_tokens_total"))
        messages += [
            {"role": "assistant", "content": resp.choices[0].message.content},
            {"role": "user", "content": f"And then, part {turn + 2}?"},
        ]
    for k in range(1, 4):  # most of turn k-1's prompt is reused by turn k (on the entry model at least)
        assert hits[k] - hits[k - 1] >= 0.5 * prompts[k - 1], (k, hits, prompts)
    rates = {labels: v for (name, labels), v in metrics(url).items() if name == "tokenrouter_prefix_cache_hit_rate"}
    assert set(rates) == {(("model", "small"),), (("model", "large"),)} and max(rates.values()) > 0.2
    cached = [v for (name, _), v in metrics(url).items() if name == "tokenrouter_kv_cached_blocks"]
    assert len(cached) == 2 and max(cached) > 0
