"""OpenAI response objects (completion, chat completion, their stream chunks, usage, token
log-probabilities in the completions and the chat shape) and the ``tokenrouter`` extension field
that carries each request's routing: the model that wrote each token, hops, discarded tokens, the
large model's share and the time to the first token."""

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
    return {
        "writers": list(out.token_models),
        "hops": out.hops,
        "discarded": out.discarded,
        "large_fraction": out.token_models.count(models[-1]) / n if n else 0.0,
        "ttft_s": out.ttft_s,
        "latency_s": out.latency_s,
        "entry": handle.entry,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
    }


def extension(handles, models: list[str], policy_label: str) -> dict:
    """The response-level ``tokenrouter`` field: the policy and models, then the routing of the
    request (one prompt) or a ``choices`` list of them (several prompts)."""
    head = {"policy": policy_label, "models": list(models)}
    infos = [routing(h, models) for h in handles]
    if len(infos) == 1:
        return head | infos[0]
    return head | {"choices": infos}


def _forced(h, prep) -> int:
    """Output tokens of ``h`` that are its prompt, scored (echo + logprobs), not generated."""
    return len(prep.forced[h.output.index // prep.n]) if prep is not None and prep.forced is not None else 0


def usage(handles, prep=None) -> dict:
    """Prompt and completion tokens of ``handles`` (a scored prompt counts as prompt)."""
    if prep is not None and prep.prompt_ids is not None:
        prompt = sum(len(prep.prompt_ids[h.output.index // prep.n]) for h in handles)
    else:
        prompt = sum(len(h.config.prompt_ids) for h in handles)
    completion = sum(len(h.output.token_ids) - _forced(h, prep) for h in handles)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_text(tokenizer, t: int, as_id: bool = False) -> str:
    """One token as text (special tokens shown), or ``"token_id:<id>"`` with ``as_id``."""
    return f"token_id:{int(t)}" if as_id else tokenizer.decode([int(t)])


def _tops(tokenizer, ids, lps, tops, k: int, as_id: bool = False) -> list:
    """Per token ``[(text, logprob), ...]``: the top ``k`` alternatives, or (k = 0) the token itself."""
    if k == 0 or tops is None:
        return [[(token_text(tokenizer, t, as_id), lp)] for t, lp in zip(ids, lps)]
    return [[(token_text(tokenizer, a, as_id), v) for a, v in top.items()] for top in tops]


def completion_logprobs(
    tokenizer, ids: list[int], lps: list, tops, k: int, lead: list[int] = (), as_id: bool = False
) -> dict:
    """The ``logprobs`` object of a text completion: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (``{text: logprob}`` per token) and ``text_offset`` (characters into the
    choice's text). ``lead``: prompt tokens the text starts with that have no log-probability
    (the first of an echoed prompt): null there. ``as_id``: tokens as ``"token_id:<id>"``."""
    texts = [token_text(tokenizer, t, as_id) for t in [*lead, *ids]]
    offsets, at = [], 0
    for t in texts:
        offsets.append(at)
        at += len(t)
    top = [None] * len(lead) + [dict(x) for x in _tops(tokenizer, ids, lps, tops, k, as_id)]
    return {
        "tokens": texts,
        "token_logprobs": [None] * len(lead) + list(lps),
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, ids: list[int], lps: list, tops, k: int, as_id: bool = False) -> dict:
    """The ``logprobs`` object of a chat choice: ``content`` with ``token``, ``logprob``,
    ``bytes`` and ``top_logprobs`` (``k`` entries of the same shape) per token."""
    content = []
    for t, lp, alts in zip(ids, lps, _tops(tokenizer, ids, lps, tops, k, as_id) if k else [[]] * len(ids)):
        text = token_text(tokenizer, t, as_id)
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode("utf-8"))} for a, v in alts],
            }
        )
    return {"content": content}


def choice_logprobs(tokenizer, h, prep) -> dict | None:
    """The ``logprobs`` of one finished choice (None when not asked for)."""
    out = h.output
    if prep.logprobs is None or out.logprobs is None:
        return None
    if prep.chat:
        return chat_logprobs(
            tokenizer, out.token_ids, out.logprobs, out.top_logprobs, prep.logprobs, prep.token_ids_as_text
        )
    if prep.echo:  # echo + logprobs: the prompt after its first token was scored (teacher-forced)
        lead = prep.prompt_ids[out.index // prep.n][:1]
        return completion_logprobs(
            tokenizer,
            out.token_ids,
            out.logprobs,
            out.top_logprobs,
            prep.logprobs,
            lead=lead,
            as_id=prep.token_ids_as_text,
        )
    return completion_logprobs(
        tokenizer, out.token_ids, out.logprobs, out.top_logprobs, prep.logprobs, as_id=prep.token_ids_as_text
    )


def choice_text(tokenizer, h, prep) -> str:
    """The text of one finished choice: with ``echo``, the prompt's text first; a scored
    prompt's tokens are not generated text."""
    out = h.output
    if not prep.echo:
        return out.text
    prompt = tokenizer.decode(prep.prompt_ids[out.index // prep.n], skip_special_tokens=True)
    f = _forced(h, prep)
    gen = out.text if not f else tokenizer.decode(out.token_ids[f:], skip_special_tokens=True)
    return prompt + gen


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


def completion(handles, prep, models: list[str], tokenizer=None) -> dict:
    """The whole (non-streamed) response body (``tokenizer``: for the text of tokens in
    ``logprobs`` and of an echoed prompt)."""
    rid, created = new_id(prep.chat), int(time.time())
    choices = []
    for i, h in enumerate(handles):
        out = h.output
        finish = FINISH.get(out.finish_reason, out.finish_reason)
        lps = choice_logprobs(tokenizer, h, prep) if tokenizer is not None else None
        if prep.chat:
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": out.text},
                    "logprobs": lps,
                    "finish_reason": finish,
                }
            )
        else:
            text = choice_text(tokenizer, h, prep) if tokenizer is not None else out.text
            choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": finish})
    return {
        "id": rid,
        "object": "chat.completion" if prep.chat else "text_completion",
        "created": created,
        "model": prep.model,
        "choices": choices,
        "usage": usage(handles, prep),
        "tokenrouter": extension(handles, models, prep.policy_label),
    }


class ChunkWriter:
    """Server-sent events of one streamed response, in OpenAI's chunk format."""

    def __init__(self, prep):
        self.prep = prep
        self.id, self.created = new_id(prep.chat), int(time.time())
        self.object = "chat.completion.chunk" if prep.chat else "text_completion"
        self.started: set[int] = set()

    def _event(self, body: dict) -> str:
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _choice(self, index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        if self.prep.chat:
            delta = {"content": text} if text else {}
            if index not in self.started:
                delta = {"role": "assistant"} | delta
            self.started.add(index)
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def logprobs(self, tokenizer, tokens: list[tuple[int, float, dict | None]]) -> dict | None:
        """The ``logprobs`` of a chunk covering ``tokens`` (``(token, logprob, top)`` each), or
        None when the request did not ask for them."""
        if self.prep.logprobs is None:
            return None
        ids, lps = [t for t, _, _ in tokens], [lp for _, lp, _ in tokens]
        tops = None if not self.prep.logprobs else [top for _, _, top in tokens]
        if self.prep.chat:
            return chat_logprobs(tokenizer, ids, lps, tops, self.prep.logprobs, self.prep.token_ids_as_text)
        return completion_logprobs(tokenizer, ids, lps, tops, self.prep.logprobs, as_id=self.prep.token_ids_as_text)

    def chunk(
        self,
        index: int,
        text: str,
        writers: list[str],
        finish: str | None = None,
        extra: dict | None = None,
        logprobs: dict | None = None,
    ) -> str:
        """One chunk: ``text`` of choice ``index``, the writers of the tokens it covers (a
        ``tokenrouter.writers`` list; text can lag its tokens while a character or a possible
        stop string is incomplete), their ``logprobs`` (when asked for), and on the last chunk of
        a choice its finish reason and ``extra`` (the routing of the whole request, and usage)."""
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.prep.model,
            "choices": [self._choice(index, text, finish, logprobs)],
        }
        if extra:
            body |= extra
        else:
            body["tokenrouter"] = {"writers": writers}
        return self._event(body)

    def usage_chunk(self, handles, ext: dict) -> str:
        """The chunk with ``choices: []`` and usage that ``stream_options.include_usage`` asks for."""
        return self._event(
            {
                "id": self.id,
                "object": self.object,
                "created": self.created,
                "model": self.prep.model,
                "choices": [],
                "usage": usage(handles, self.prep),
                "tokenrouter": ext,
            }
        )

    def error(self, err: APIError) -> str:
        return self._event(err.body())

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
