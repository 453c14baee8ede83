"""A validated request body -> what the engine runs: prompt token ids, `SamplingParams` and the
policy, with every range check done here so that bad input is a 400 naming the field and the
fix, before anything reaches the engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pydantic import ValidationError

from ..policy import Policy
from ..prompts import PromptEncoder
from ..request import SamplingParams
from .errors import bad_request
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from .state import ServeState

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's chat limit, vLLM's default)
MAX_CHOICES = 1024  # prompts x n of one request at most


@dataclass
class Prepared:
    """One request, ready for `tokenrouter_sdk.serve.generation.Generation`.

    Attributes:
        prompts: token ids per prompt as the engine runs them, shapes [P_i] (with ``forced``,
            each prompt's first token only).
        params: sampling and stopping, shared or one per prompt (``n`` samples each).
        policy, policy_label: the routing policy and how responses name it.
        stream, include_usage: server-sent events; a usage chunk at the end.
        model: the ``model`` echoed in responses.
        chat: a chat completion (else a text completion).
        n: choices per prompt (choice ``i * n + j`` is sample j of prompt i).
        logprobs: top alternatives per token for the ``logprobs`` of each choice, or None (off).
        echo: the completion's text (and logprobs) start with the prompt's.
        prompt_ids: each prompt's token ids as sent, shapes [P_i].
        forced: with ``echo`` and ``logprobs``: per prompt, its tokens after the first, written
            by teacher forcing through the policy (so each prompt token gets the log-probability
            of the model the policy routes it to); else None.
        token_ids_as_text: tokens in ``logprobs`` are shown as ``"token_id:<id>"`` (vLLM's
            ``return_tokens_as_token_ids``: unique, where two tokens may decode to one text).
        sources: served models that do not share a tokenizer: each prompt as sent (text, or
            chat messages), which the engine renders for each model in its own vocabulary and
            chat template (``prompts`` and ``prompt_ids`` are then the last model's tokens, for
            the length checks and usage); else None.
    """

    prompts: list[list[int]]
    params: SamplingParams | list[SamplingParams]
    policy: Policy
    policy_label: str
    stream: bool
    include_usage: bool
    model: str
    chat: bool
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    prompt_ids: list[list[int]] | None = None
    forced: list[list[int]] | None = None
    token_ids_as_text: bool = False
    sources: list | None = None


def _unsupported(req, chat: bool) -> None:
    if req.n is not None and req.n < 1:
        raise bad_request("n", f"n must be at least 1 (choices per prompt), got {req.n}")
    if req.presence_penalty not in (None, 0, 0.0):
        raise bad_request("presence_penalty", "presence_penalty is not supported; leave it out or send 0")
    if req.frequency_penalty not in (None, 0, 0.0):
        raise bad_request("frequency_penalty", "frequency_penalty is not supported; leave it out or send 0")
    if req.logit_bias:
        raise bad_request("logit_bias", "logit_bias is not supported; leave it out")
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")
        if req.tools:
            raise bad_request("tools", "tools (function calling) are not supported; leave tools out")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("response_format", "only response_format {'type': 'text'} is supported")
    else:
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise bad_request(
                "logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}] (top alternatives per token), got {req.logprobs}"
            )
        if req.echo and req.stream:
            raise bad_request("echo", "echo with stream is not supported; send stream: false")
        if req.echo and req.logprobs is not None and req.stop:
            raise bad_request(
                "stop",
                "stop with echo and logprobs is not supported (the prompt is scored token by "
                "token and a stop string could end it there); leave stop out",
            )
        if req.best_of not in (None, 1):
            raise bad_request("best_of", f"best_of={req.best_of}: only 1 is supported")
        if req.suffix:
            raise bad_request("suffix", "suffix (insertion) is not supported; leave it out")


def _check_ids(router, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise bad_request(param, f"{param} is empty: give at least one token of text")
    vocab = router.vocab_limit
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise bad_request(param, f"{param} has token id {bad}, outside the vocabulary [0, {vocab})")
    ctx = router.max_context
    if len(ids) >= ctx:
        raise bad_request(
            param,
            f"{param} has {len(ids)} tokens but the models' context is {ctx} tokens: shorten it "
            f"to at most {ctx - 1} tokens",
            "context_length_exceeded",
        )
    return ids


def completion_prompts(
    router, prompt, chat_template_kwargs: dict | None = None, add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of a completions ``prompt`` (raw text: no chat template; with the tokenizer's
    special tokens, e.g. a BOS, unless ``add_special_tokens`` is False, as vLLM does), one list
    per prompt; a list of chat messages is rendered with the chat template (and
    ``chat_template_kwargs``).

    Raises:
        APIError: 400 naming ``prompt`` (empty, out-of-vocabulary ids, longer than the context),
            or ``chat_template_kwargs`` with a prompt that is not chat messages.
    """
    if prompt and isinstance(prompt, list) and isinstance(prompt[0], dict):
        try:
            messages = [ChatMessage.model_validate(m) for m in prompt]
        except ValidationError:
            raise bad_request("prompt", "prompt: a list of objects must be chat messages {'role', 'content'}") from None
        return [chat_prompt(router, messages, "prompt", chat_template_kwargs)]
    if chat_template_kwargs:
        raise bad_request(
            "chat_template_kwargs",
            "chat_template_kwargs apply to chat messages; this prompt is text "
            "or token ids, sent as it is (no chat template)",
        )
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt", "prompt is empty: give a string, a list of strings or token ids")
    out = []
    for p in items:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt", "prompt is empty: give at least one character of text")
            ids = router.encode(p, chat=False, add_special_tokens=add_special_tokens)
        else:
            ids = [int(i) for i in p]
        out.append(_check_ids(router, ids, "prompt"))
    return out


def chat_prompt(router, messages, param: str = "messages", chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of chat ``messages`` rendered with the tokenizer's chat template, with the
    template variables ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``).

    Raises:
        APIError: 400 naming ``messages`` (none, a non-text part, no template, too long) or
            ``chat_template_kwargs`` (a variable the server sets itself).
    """
    plain = plain_messages(messages, param)
    if not getattr(router.tokenizer, "chat_template", None):
        raise bad_request(
            param, "the served tokenizer has no chat template: use /v1/completions with a prompt string instead"
        )
    try:
        PromptEncoder.check_template_kwargs(chat_template_kwargs)
    except (TypeError, ValueError) as e:
        raise bad_request("chat_template_kwargs", str(e)) from None
    try:
        ids = router.encode(plain, chat_template_kwargs=chat_template_kwargs)
    except Exception as e:  # noqa: BLE001 - the template refused the conversation (e.g. role order)
        raise bad_request(
            param, f"messages could not be rendered with the chat template: {type(e).__name__}: {e}"
        ) from None
    return _check_ids(router, ids, param)


def plain_messages(messages, param: str = "messages") -> list[dict]:
    """Chat ``messages`` as ``{"role", "content"}`` dicts with text content (text parts joined).

    Raises:
        APIError: 400 naming ``param`` (none, a non-text part, every message empty).
    """
    if not messages:
        raise bad_request(param, f"{param} is empty: give at least one {{'role': 'user', 'content': ...}}")
    plain = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"{param}.{i}.content",
                        f"{param}[{i}].content: only text parts "
                        f"({{'type': 'text', 'text': ...}}) are supported, got type {part.get('type')!r}",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        plain.append({"role": m.role, "content": content or ""})
    if not any(p["content"] for p in plain):
        raise bad_request(param, "every message is empty: give some text in at least one message")
    return plain


def mixed_sources(router, req, chat: bool) -> list:
    """Served models that do not share a tokenizer: each prompt of ``req`` as sent (a string,
    or chat messages), for the engine to render for each model.

    Raises:
        APIError: 400 for what only one vocabulary can mean: token-id prompts, stop token ids,
            logprobs (each token shown as text of one tokenizer).
    """
    if req.logprobs if chat else req.logprobs is not None:
        raise bad_request(
            "logprobs",
            "logprobs name each token's text, and the served models do not share a "
            "tokenizer; leave logprobs out (Router.generate(logprobs=...) gives them per "
            "writer)",
        )
    if getattr(req, "stop_token_ids", None):
        raise bad_request(
            "stop_token_ids",
            "stop_token_ids name different tokens in each served model's vocabulary "
            "(they do not share a tokenizer): use stop strings",
        )
    if chat:
        return [plain_messages(req.messages, "messages")]
    prompt = req.prompt
    if prompt and isinstance(prompt, list) and isinstance(prompt[0], dict):
        return [plain_messages(prompt, "prompt")]
    items = [prompt] if isinstance(prompt, str) else list(prompt or [])
    if any(not isinstance(p, str) for p in items):
        raise bad_request(
            "prompt",
            "prompt: token ids mean different text in each served model's vocabulary (they "
            "do not share a tokenizer): send the prompt as text",
        )
    return items


def sampling(router, req, prompts: list[list[int]], default_max: int | None) -> SamplingParams:
    """`SamplingParams` of a request; OpenAI's defaults (temperature 1, top_p 1).

    Raises:
        APIError: 400 naming the field (max_tokens <= 0 or beyond the context or the KV pool,
            negative temperature, top_p outside (0, 1], negative top_k, an empty stop string).
    """
    longest = max(len(p) for p in prompts)
    ctx = router.max_context
    name = "max_tokens"
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    scoring = getattr(req, "echo", False) and getattr(req, "logprobs", None) is not None
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else ctx - longest
        max_tokens = min(max_tokens, ctx - longest)
    elif max_tokens == 0 and scoring and min(len(p) for p in prompts) > 1:
        pass  # echo + logprobs: the prompt alone is scored
    elif max_tokens <= 0:
        raise bad_request(
            name,
            f"{name} must be at least 1, got {max_tokens}"
            + (" (0 only with echo and logprobs, for prompts of 2+ tokens)" if max_tokens == 0 else ""),
        )
    elif longest + max_tokens > ctx:
        raise bad_request(
            name,
            f"{name}={max_tokens} with a prompt of {longest} tokens exceeds the context of {ctx} "
            f"tokens: set {name} to at most {ctx - longest}",
            "context_length_exceeded",
        )
    for model, (blocks, bs) in router.kv_capacity.items():
        if longest + max_tokens > blocks * bs:
            raise bad_request(
                name,
                f"the prompt ({longest} tokens) plus {name}={max_tokens} does not fit the KV pool "
                f"of model '{model}' ({blocks * bs} tokens): lower {name} to at most "
                f"{blocks * bs - longest}",
            )
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < 0:
        raise bad_request("temperature", f"temperature must be >= 0 (0 = greedy), got {temperature}")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise bad_request("top_p", f"top_p must be in (0, 1], got {top_p}; 1 disables nucleus sampling")
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k < 0:
        raise bad_request("top_k", f"top_k must be >= 0 (0 or -1 = off), got {top_k}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise bad_request("stop", "stop strings must be non-empty; remove the empty string")
    ids = list(req.stop_token_ids or [])
    if any(i < 0 for i in ids):
        raise bad_request("stop_token_ids", f"stop_token_ids must be non-negative, got {ids}")
    return SamplingParams(
        max_new_tokens=max(1, int(max_tokens)),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        seed=req.seed,
        stop=tuple(stop),
        stop_token_ids=tuple(ids),
        ignore_eos=bool(req.ignore_eos),
        logprobs=_logprobs(req),
        n=int(req.n or 1),
    ).validate()


def _logprobs(req) -> int | None:
    """Top alternatives per token the request asks for, or None (no logprobs)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def prepare(state: ServeState, req: CompletionRequest | ChatCompletionRequest) -> Prepared:
    """Everything the engine needs for ``req``; every check that can fail is done here.

    Raises:
        APIError: 400/404 naming the field at fault.
    """
    chat = isinstance(req, ChatCompletionRequest)
    _unsupported(req, chat)
    policy, label = state.resolve(req.model, req.policy)
    router = state.router
    if chat:
        prompts = [chat_prompt(router, req.messages, "messages", req.chat_template_kwargs)]
        default_max = None
    else:
        prompts = completion_prompts(router, req.prompt, req.chat_template_kwargs, bool(req.add_special_tokens))
        default_max = COMPLETIONS_DEFAULT_MAX_TOKENS
    n = int(req.n or 1)
    if n * len(prompts) > MAX_CHOICES:
        raise bad_request(
            "n", f"{len(prompts)} prompts x n={n} is {n * len(prompts)} choices; at most {MAX_CHOICES} per request"
        )
    params = sampling(router, req, prompts, default_max)
    stream = bool(req.stream)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    echo = bool(getattr(req, "echo", False))
    prep = Prepared(
        prompts,
        params,
        policy,
        label,
        stream,
        include_usage,
        req.model or state.model_id,
        chat,
        n=n,
        logprobs=params.logprobs,
        echo=echo,
        prompt_ids=[list(p) for p in prompts],
        token_ids_as_text=bool(req.return_tokens_as_token_ids),
        sources=mixed_sources(router, req, chat) if router.text is not None else None,
    )
    if echo and params.logprobs is not None:  # score the prompt: its tokens after the first are teacher-forced
        max_tokens = 0 if req.max_tokens == 0 else params.max_new_tokens
        prep.forced = [p[1:] for p in prompts]
        prep.prompts = [p[:1] for p in prompts]
        prep.params = [dataclasses.replace(params, max_new_tokens=len(p) - 1 + max_tokens) for p in prompts]
    return prep
