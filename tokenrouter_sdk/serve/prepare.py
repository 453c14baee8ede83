"""A validated request body -> what the engine runs: prompt token ids, `SamplingParams` and the
policy, with every range check done here so that bad input is a 400 naming the field and the
fix, before anything reaches the engine."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from ..policy import Policy
from ..request import SamplingParams
from .errors import bad_request
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from .state import ServeState

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Prepared:
    """One request, ready for `tokenrouter_sdk.serve.generation.Generation`.

    Attributes:
        prompts: token ids per choice, shapes [P_i].
        params: sampling and stopping (shared by the choices).
        policy, policy_label: the routing policy and how responses name it.
        stream, include_usage: server-sent events; a usage chunk at the end.
        model: the ``model`` echoed in responses.
        chat: a chat completion (else a text completion).
    """

    prompts: list[list[int]]
    params: SamplingParams
    policy: Policy
    policy_label: str
    stream: bool
    include_usage: bool
    model: str
    chat: bool


def _unsupported(req, chat: bool) -> None:
    if req.n not in (None, 1):
        raise bad_request("n", f"n={req.n}: only n=1 is supported; send {req.n} requests (with different seeds) "
                               "instead")
    if req.presence_penalty not in (None, 0, 0.0):
        raise bad_request("presence_penalty", "presence_penalty is not supported; leave it out or send 0")
    if req.frequency_penalty not in (None, 0, 0.0):
        raise bad_request("frequency_penalty", "frequency_penalty is not supported; leave it out or send 0")
    if req.logit_bias:
        raise bad_request("logit_bias", "logit_bias is not supported; leave it out")
    if chat:
        if req.logprobs or req.top_logprobs:
            raise bad_request("logprobs", "logprobs are not supported by this server (the engine does not return "
                                          "token log-probabilities); leave logprobs out or send false")
        if req.tools:
            raise bad_request("tools", "tools (function calling) are not supported; leave tools out")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("response_format", "only response_format {'type': 'text'} is supported")
    else:
        if req.logprobs is not None:
            raise bad_request("logprobs", "logprobs are not supported by this server (the engine does not return "
                                          "token log-probabilities); leave logprobs out or send null")
        if req.echo:
            raise bad_request("echo", "echo is not supported; leave it out or send false")
        if req.best_of not in (None, 1):
            raise bad_request("best_of", f"best_of={req.best_of}: only 1 is supported")
        if req.suffix:
            raise bad_request("suffix", "suffix (insertion) is not supported; leave it out")


def _check_ids(router, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise bad_request(param, f"{param} is empty: give at least one token of text")
    vocab = router.engine.vocab_limit
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise bad_request(param, f"{param} has token id {bad}, outside the vocabulary [0, {vocab})")
    ctx = router.max_context
    if len(ids) >= ctx:
        raise bad_request(param, f"{param} has {len(ids)} tokens but the models' context is {ctx} tokens: shorten it "
                                 f"to at most {ctx - 1} tokens", "context_length_exceeded")
    return ids


def completion_prompts(router, prompt) -> list[list[int]]:
    """Token ids of a completions ``prompt`` (raw text: no chat template), one list per choice.

    Raises:
        APIError: 400 naming ``prompt`` (empty, out-of-vocabulary ids, longer than the context).
    """
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and isinstance(prompt[0], dict):
        try:
            messages = [ChatMessage.model_validate(m) for m in prompt]
        except ValidationError:
            raise bad_request("prompt", "prompt: a list of objects must be chat messages {'role', 'content'}") from None
        return [chat_prompt(router, messages, "prompt")]
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
            ids = router.encode(p, chat=False)
        else:
            ids = [int(i) for i in p]
        out.append(_check_ids(router, ids, "prompt"))
    return out


def chat_prompt(router, messages, param: str = "messages") -> list[int]:
    """Token ids of chat ``messages`` rendered with the tokenizer's chat template.

    Raises:
        APIError: 400 naming ``messages`` (none, a non-text part, no template, too long).
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
                    raise bad_request(f"{param}.{i}.content", f"{param}[{i}].content: only text parts "
                                      f"({{'type': 'text', 'text': ...}}) are supported, got type {part.get('type')!r}")
                parts.append(part["text"])
            content = "".join(parts)
        plain.append({"role": m.role, "content": content or ""})
    if not any(p["content"] for p in plain):
        raise bad_request(param, "every message is empty: give some text in at least one message")
    if not getattr(router.tokenizer, "chat_template", None):
        raise bad_request(param, "the served tokenizer has no chat template: use /v1/completions with a "
                                      "prompt string instead")
    try:
        ids = router.encode(plain)
    except Exception as e:  # noqa: BLE001 - the template refused the conversation (e.g. role order)
        raise bad_request(param, f"messages could not be rendered with the chat template: "
                                      f"{type(e).__name__}: {e}") from None
    return _check_ids(router, ids, param)


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
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else ctx - longest
        max_tokens = min(max_tokens, ctx - longest)
    elif max_tokens <= 0:
        raise bad_request(name, f"{name} must be at least 1, got {max_tokens}")
    elif longest + max_tokens > ctx:
        raise bad_request(name, f"{name}={max_tokens} with a prompt of {longest} tokens exceeds the context of {ctx} "
                                f"tokens: set {name} to at most {ctx - longest}", "context_length_exceeded")
    for model, (blocks, bs) in router.engine.capacity.items():
        if longest + max_tokens > blocks * bs:
            raise bad_request(name, f"the prompt ({longest} tokens) plus {name}={max_tokens} does not fit the KV pool "
                                    f"of model '{model}' ({blocks * bs} tokens): lower {name} to at most "
                                    f"{blocks * bs - longest}")
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
    return SamplingParams(max_new_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                          top_k=int(top_k), seed=req.seed, stop=tuple(stop), stop_token_ids=tuple(ids),
                          ignore_eos=bool(req.ignore_eos)).validate()


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
        prompts = [chat_prompt(router, req.messages)]
        default_max = None
    else:
        prompts = completion_prompts(router, req.prompt)
        default_max = COMPLETIONS_DEFAULT_MAX_TOKENS
    params = sampling(router, req, prompts, default_max)
    stream = bool(req.stream)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Prepared(prompts, params, policy, label, stream, include_usage, req.model or state.model_id, chat)
