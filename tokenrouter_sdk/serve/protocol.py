"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's fields, plus
the extensions ``top_k``, ``policy``, ``ignore_eos``, ``stop_token_ids`` and vLLM's
``chat_template_kwargs``, ``return_tokens_as_token_ids`` and, for completions,
``add_special_tokens``), validated with
pydantic. Unknown fields are ignored, as OpenAI does; a field of the wrong type is a 400 naming
it. Range checks (max_tokens against the context, temperature, top_p, ...) live in
`tokenrouter_sdk.serve.prepare`, where the context is known."""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import bad_request

StrOrList = Union[str, list[str], None]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: StrOrList = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    policy: str | dict[str, Any] | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool | None = False


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or
    a list of token-id lists (one choice per prompt); a list of chat messages is rendered with the
    chat template (what lm-evaluation-harness sends with ``--apply_chat_template``). A text
    prompt is encoded with the tokenizer's special tokens (e.g. a BOS) unless
    ``add_special_tokens`` is false (vLLM's field and default)."""

    prompt: Union[str, list[int], list[str], list[list[int]], list[dict[str, Any]]]
    add_special_tokens: bool = True
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: ``messages`` are rendered with the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


def parse(cls: type[BaseModel], data: Any) -> BaseModel:
    """``data`` (the decoded JSON body) as ``cls``.

    Raises:
        APIError: 400 naming the first bad field, what it must be and what was sent.
    """
    if not isinstance(data, dict):
        raise bad_request(None, f"the body must be a JSON object, got a JSON {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        # a union reports each member's error under its type name: keep the field path only
        field = loc[0] if loc else None
        if err.get("type") == "missing":
            raise bad_request(field, f"'{field}' is required", "missing_required_parameter") from None
        got = err.get("input")
        shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
        raise bad_request(field, f"'{field}': {err.get('msg', 'invalid value')} (got {shown})") from None
