"""Text prompts are encoded with the tokenizer's special tokens (its BOS), as ``tokenizer(text)``,
transformers' pipelines and vLLM do, unless a call or a server request says
``add_special_tokens=False``; chat-rendered prompts keep the template's own BOS (never two).
The tokenizer here is the tiny byte-level one with a BOS it adds (Gemma's and Llama's
behaviour) and no chat template, the case where a text prompt is encoded as it is."""

import asyncio

import httpx
import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_tokenizer
from tokenrouter_sdk.policies import SingleModel

TEXT = "The capital of France is"
N = 6


def bos_tokenizer(template: str | None = None):
    """The tiny tokenizer adding ``<|bos|>`` (id 256) to every text it encodes, with
    ``template`` as its chat template (None: none)."""
    tok = tiny_tokenizer()
    tok.add_bos_token = True
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def router(pair):
    with Router(pair, SingleModel("large"), tokenizer=bos_tokenizer()) as r:
        yield r


def test_text_is_encoded_as_the_tokenizer_encodes_it(router):
    tok = router.tokenizer
    want = tok(TEXT).input_ids
    assert want[0] == tok.bos_token_id == 256 and want[1:] == tok.encode(TEXT, add_special_tokens=False)
    assert router.encode(TEXT) == want
    assert router.encode(TEXT, add_special_tokens=False) == want[1:]
    assert router.encode("<|bos|>" + TEXT) == want  # a text holding its own BOS keeps one
    assert router.encode([1, 2, 3]) == [1, 2, 3]  # token ids as given
    assert router.requests([TEXT])[0].prompt_ids == want
    assert router.requests([TEXT], add_special_tokens=False)[0].prompt_ids == want[1:]


def test_generate_submit_and_stream_take_add_special_tokens_per_call(router):
    tok = router.tokenizer
    with_bos, without = tok(TEXT).input_ids, tok(TEXT).input_ids[1:]
    ref = router.generate([with_bos, without], max_new_tokens=N)
    assert ref[0].token_ids != ref[1].token_ids  # the BOS changes what the model writes
    assert router.generate(TEXT, max_new_tokens=N).token_ids == ref[0].token_ids
    assert router.generate(TEXT, max_new_tokens=N, add_special_tokens=False).token_ids == ref[1].token_ids
    call = router.submit([TEXT], max_new_tokens=N, add_special_tokens=False)
    call.wait(60)
    assert call.outputs[0].token_ids == ref[1].token_ids
    streamed = [e.token_id for e in router.stream(TEXT, max_new_tokens=N, add_special_tokens=False)]
    assert [t for t in streamed if t is not None] == ref[1].token_ids
    out = asyncio.run(router.agenerate(TEXT, max_new_tokens=N, add_special_tokens=False))
    assert out.token_ids == ref[1].token_ids
    scored = router.score([TEXT, TEXT], [ref[0].token_ids, ref[0].token_ids], policy=SingleModel("large"))
    assert scored[0].logprobs == pytest.approx(
        router.score([with_bos], [ref[0].token_ids], policy=SingleModel("large"))[0].logprobs, abs=1e-9
    )


def test_chat_prompts_carry_one_bos(pair):
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tok = bos_tokenizer(template)
    messages = [{"role": "user", "content": TEXT}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert rendered[0] == 256 and rendered[1] != 256
    with Router(pair, SingleModel("large"), tokenizer=tok) as r:
        assert r.encode(messages) == rendered
        assert r.encode(TEXT) == rendered  # a string is rendered with the template: unchanged
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert r.encode(text) == rendered  # already rendered (holds the BOS): one BOS, not two


def test_server_completions_take_add_special_tokens(pair):
    pytest.importorskip("fastapi")
    with Router(pair, SingleModel("large"), tokenizer=bos_tokenizer()) as router:
        _check_server(router, router.serve())


def _check_server(router, url):
    body = {"model": "tokenrouter", "prompt": TEXT, "max_tokens": N, "temperature": 0}
    plain = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    bare = httpx.post(url + "/v1/completions", json={**body, "add_special_tokens": False}, timeout=60).json()
    assert plain["usage"]["prompt_tokens"] == len(TEXT) + 1 and bare["usage"]["prompt_tokens"] == len(TEXT)
    assert plain["choices"][0]["text"] == router.generate(TEXT, max_new_tokens=N).text
    assert bare["choices"][0]["text"] == router.generate(TEXT, max_new_tokens=N, add_special_tokens=False).text
    toks = httpx.post(url + "/tokenize", json={"prompt": TEXT}).json()["tokens"]
    assert toks == router.tokenizer(TEXT).input_ids
    assert (
        httpx.post(url + "/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"] == toks[1:]
    )
    bad = httpx.post(url + "/v1/completions", json={**body, "add_special_tokens": "sometimes"}, timeout=60)
    assert bad.status_code == 400 and "add_special_tokens" in bad.text


def test_lm_eval_model_adds_the_bos_as_lm_eval_does(router):
    pytest.importorskip("lm_eval")
    from tokenrouter_sdk.eval.lm_eval_model import TokenRouterLM

    assert TokenRouterLM(router=router).add_bos_token is False  # lm-eval's hf/vllm default
    lm = TokenRouterLM(router=router, add_bos_token=True)
    assert lm.tok_encode(TEXT) == router.tokenizer(TEXT).input_ids
    assert lm.tok_encode(TEXT, add_special_tokens=False) == router.tokenizer(TEXT).input_ids[1:]
    gemma = bos_tokenizer()
    gemma.name_or_path = "/models/gemma-3-270m"
    from tokenrouter_sdk.eval.lm_eval_model import _is_gemma

    assert _is_gemma(gemma) and not _is_gemma(router.tokenizer)
