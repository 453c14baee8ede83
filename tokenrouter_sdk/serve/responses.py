"""OpenAI response objects (completion, chat completion, their stream chunks, usage) and the
``tokenrouter`` extension field that carries each request's routing: the model that wrote each
token, hops, discarded tokens, the large model's share and the time to the first token."""

from __future__ import annotations

import json
import time
import uuid

from .errors import APIError

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def routing(handle, models: list[str]) -> dict:
    """The ``tokenrouter`` fields of one finished request.

    Returns:
        ``writers`` (model per committed token, aligned with the output tokens), ``hops``,
        ``discarded`` (sampled tokens dropped on handoffs), ``large_fraction`` (share of the
        tokens written by the last, largest model), ``ttft_s`` and ``latency_s`` (seconds from
        admission), ``entry`` (the model that prefilled it), ``finish_reason`` (the engine's:
        eos | length | stop | aborted | failed) and ``stop_reason``.
    """
    out = handle.output
    n = len(out.token_models)
    return {"writers": list(out.token_models), "hops": out.hops, "discarded": out.discarded,
            "large_fraction": out.token_models.count(models[-1]) / n if n else 0.0,
            "ttft_s": out.ttft_s, "latency_s": out.latency_s, "entry": handle.entry,
            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}


def extension(handles, models: list[str], policy_label: str) -> dict:
    """The response-level ``tokenrouter`` field: the policy and models, then the routing of the
    request (one prompt) or a ``choices`` list of them (several prompts)."""
    head = {"policy": policy_label, "models": list(models)}
    infos = [routing(h, models) for h in handles]
    if len(infos) == 1:
        return head | infos[0]
    return head | {"choices": infos}


def usage(handles) -> dict:
    prompt = sum(len(h.config.prompt_ids) for h in handles)
    completion = sum(len(h.output.token_ids) for h in handles)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def raise_for_failure(handles) -> None:
    """Raise the error of the first request that failed or was aborted.

    Raises:
        APIError: 500 naming the failure (a policy that raised is named in the engine's error,
            e.g. ``policy MyPolicy().route raised ...``), or 503 for an abort.
    """
    for h in handles:
        out = h.output
        if out.finish_reason == "failed":
            code = "policy_error" if (out.error or "").startswith("policy ") else "request_failed"
            raise APIError(500, f"the request failed: {out.error}", None, code)
        if out.finish_reason == "aborted":
            raise APIError(503, f"the request was aborted: {out.error}", None, "aborted")


def completion(handles, prep, models: list[str]) -> dict:
    """The whole (non-streamed) response body."""
    rid, created = new_id(prep.chat), int(time.time())
    choices = []
    for i, h in enumerate(handles):
        out = h.output
        finish = FINISH.get(out.finish_reason, out.finish_reason)
        if prep.chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                            "finish_reason": finish})
        else:
            choices.append({"index": i, "text": out.text, "logprobs": None, "finish_reason": finish})
    return {"id": rid, "object": "chat.completion" if prep.chat else "text_completion", "created": created,
            "model": prep.model, "choices": choices, "usage": usage(handles),
            "tokenrouter": extension(handles, models, prep.policy_label)}


class ChunkWriter:
    """Server-sent events of one streamed response, in OpenAI's chunk format."""

    def __init__(self, prep):
        self.prep = prep
        self.id, self.created = new_id(prep.chat), int(time.time())
        self.object = "chat.completion.chunk" if prep.chat else "text_completion"
        self.started: set[int] = set()

    def _event(self, body: dict) -> str:
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _choice(self, index: int, text: str, finish: str | None) -> dict:
        if self.prep.chat:
            delta = {"content": text} if text else {}
            if index not in self.started:
                delta = {"role": "assistant"} | delta
            self.started.add(index)
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def chunk(self, index: int, text: str, writers: list[str], finish: str | None = None, extra: dict | None = None
              ) -> str:
        """One chunk: ``text`` of choice ``index``, the writers of the tokens it covers (a
        ``tokenrouter.writers`` list; text can lag its tokens while a character or a possible
        stop string is incomplete), and on the last chunk of a choice its finish reason and
        ``extra`` (the routing of the whole request, and usage)."""
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.prep.model,
                "choices": [self._choice(index, text, finish)]}
        if extra:
            body |= extra
        else:
            body["tokenrouter"] = {"writers": writers}
        return self._event(body)

    def usage_chunk(self, handles, ext: dict) -> str:
        """The chunk with ``choices: []`` and usage that ``stream_options.include_usage`` asks for."""
        return self._event({"id": self.id, "object": self.object, "created": self.created, "model": self.prep.model,
                            "choices": [], "usage": usage(handles), "tokenrouter": ext})

    def error(self, err: APIError) -> str:
        return self._event(err.body())

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
