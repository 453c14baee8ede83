"""The HTTP endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (plain or
server-sent events), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, and ``/tokenize``,
``/detokenize``, ``/tokenizer_info`` (what lm-evaluation-harness's remote tokenizer asks for)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .body import read_json
from .errors import APIError, bad_request
from .generation import Disconnected, Generation
from .prepare import Prepared, prepare
from .protocol import ChatCompletionRequest, CompletionRequest, parse
from .responses import FINISH, ChunkWriter, completion, extension, raise_for_failure, routing, usage
from .state import ServeState

HEALTH_WAIT_S = 5.0  # seconds /health waits for every sub-server's KV report
BUSY_GRACE_S = 300.0  # a sub-server that did not answer but stepped this recently is busy, not hung
CLIENT_CLOSED = 499  # nginx's "client closed request": never seen by the client, shown in access logs

api = APIRouter()


def _state(request: Request) -> ServeState:
    return request.app.state.tr


async def _generate(request: Request, cls) -> Response:
    st = _state(request)
    req = parse(cls, await read_json(request, st.max_body_bytes))
    prep = prepare(st, req)
    gen = Generation(st.router, prep, request.receive, prep.stream)
    st.active.add(gen)
    streaming = False
    try:
        if not prep.stream:
            try:
                await gen.wait()
            except Disconnected:
                return Response(status_code=CLIENT_CLOSED)
            raise_for_failure(gen.handles)
            return JSONResponse(completion(gen.handles, prep, list(st.router.models), st.router.tokenizer))
        try:
            first = await gen.next_events()  # headers go out with the first token, or an error instead
        except Disconnected:
            return Response(status_code=CLIENT_CLOSED)
        failed = [h for h in gen.handles if h.done.is_set() and not h.output.ok]
        if failed:
            gen.abort("another prompt of the request failed")
            raise_for_failure(failed)
        streaming = True
        return StreamingResponse(
            _events(st, gen, prep, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    finally:
        if not streaming:
            gen.close()
            st.active.discard(gen)


async def _events(st: ServeState, gen: Generation, prep: Prepared, items: list):
    """The SSE body: text chunks as tokens are committed (events already waiting are merged),
    a last chunk per choice with its finish reason, usage and routing, then ``[DONE]``. A
    request that fails after the first token ends the stream with an OpenAI error event."""
    models, tok = list(st.router.models), st.router.tokenizer
    writer = ChunkWriter(prep)
    pending: dict[int, list[str]] = {}
    scored: dict[int, list] = {}  # per choice, (token, logprob, top) of the tokens not sent yet
    try:
        while True:
            texts: dict[int, list[str]] = {}
            ended: list[int] = []
            for kind, idx, payload in items:
                if kind == "tokens":
                    ev, piece = payload
                    pending.setdefault(idx, []).extend([ev.model] * len(ev.tokens))
                    if ev.logprobs is not None:
                        scored.setdefault(idx, []).extend(
                            (t, lp, dict(top)) for t, (lp, top) in zip(ev.tokens, ev.logprobs)
                        )
                    texts.setdefault(idx, []).append(piece)
                else:
                    texts.setdefault(idx, []).append(payload)
                    ended.append(idx)
            for idx, parts in texts.items():
                text = "".join(parts)
                if idx in ended:
                    continue
                if text:
                    yield writer.chunk(
                        idx, text, pending.pop(idx, []), logprobs=writer.logprobs(tok, scored.pop(idx, []))
                    )
            for idx in ended:
                h = gen.handles[idx]
                text = "".join(texts.get(idx, []))
                if not h.output.ok:
                    if text:
                        yield writer.chunk(
                            idx, text, pending.pop(idx, []), logprobs=writer.logprobs(tok, scored.pop(idx, []))
                        )
                    gen.abort("another prompt of the request failed")
                    try:
                        raise_for_failure([h])
                    except APIError as e:
                        yield writer.error(e)
                    yield writer.done()
                    return
                pending.pop(idx, None)
                info = (
                    extension(gen.handles, models, prep.policy_label)
                    if len(gen.handles) == 1
                    else {"policy": prep.policy_label, "models": models, "index": idx} | routing(h, models)
                )
                lps = writer.logprobs(tok, scored.pop(idx, []))
                yield writer.chunk(
                    idx,
                    text,
                    [],
                    FINISH.get(h.output.finish_reason, h.output.finish_reason),
                    {"usage": usage([h], prep), "tokenrouter": info},
                    logprobs=lps if lps is None or lps.get("content", lps.get("tokens")) else None,
                )
            if gen.finished:
                break
            items = await gen.next_events()
        if prep.include_usage:
            yield writer.usage_chunk(gen.handles, extension(gen.handles, models, prep.policy_label))
        yield writer.done()
    except Disconnected:
        return
    finally:
        gen.close()
        st.active.discard(gen)


@api.post("/v1/completions")
async def completions(request: Request):
    return await _generate(request, CompletionRequest)


@api.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _generate(request, ChatCompletionRequest)


@api.get("/v1/models")
async def models(request: Request):
    st = _state(request)
    router = st.router
    created = int(request.app.state.started)
    names = list(router.models)
    data = [
        {
            "id": st.model_id,
            "object": "model",
            "created": created,
            "owned_by": "tokenrouter",
            "max_model_len": router.max_context,
            "tokenrouter": {"models": names, "policy": st.policy_label, "policies": st.policies.registry.names()},
        }
    ]
    data += [
        {
            "id": m,
            "object": "model",
            "created": created,
            "owned_by": "tokenrouter",
            "max_model_len": router.max_context,
            "tokenrouter": {"single_model": True},
        }
        for m in names
    ]
    return {"object": "list", "data": data}


@api.get("/health")
async def health(request: Request):
    """200 while every sub-server answers: it reports its KV pool within `HEALTH_WAIT_S`, or it
    is in the middle of stepping (a sub-server answers between steps, and one long step under
    load can outlast the wait: it counts as answering while its last step ended less than
    `BUSY_GRACE_S` ago). 503 when a sub-server is dead or silent, or the Router is closed."""
    st = _state(request)
    router = st.router
    try:
        stats = await anyio.to_thread.run_sync(router.kv_stats, HEALTH_WAIT_S)
    except RuntimeError as e:
        raise APIError(503, f"unhealthy: {e}", None, "engine_unavailable") from None
    except TimeoutError as e:
        dead, ages = router.dead, st.metrics.step_ages()
        models = {
            m: {
                "alive": m not in dead and ages.get(m, float("inf")) < BUSY_GRACE_S,
                "busy": True,
                "last_step_s_ago": ages.get(m),
                "error": dead.get(m),
            }
            for m in router.models
        }
        ok = all(v["alive"] for v in models.values())
        body = {"status": "ok" if ok else "unavailable", "models": models}
        if not ok:
            body["error"] = {
                "message": f"unhealthy: {e}",
                "type": "server_error",
                "param": None,
                "code": "engine_unavailable",
            }
        return JSONResponse(body, status_code=200 if ok else 503)
    dead = router.dead
    models = {
        m: {
            "alive": s.alive and m not in dead,
            "free_blocks": s.free_blocks,
            "num_blocks": s.num_blocks,
            "owned": s.owned,
            "pending": s.pending,
            "error": s.error or dead.get(m),
        }
        for m, s in stats.items()
    }
    ok = all(v["alive"] for v in models.values())
    return JSONResponse({"status": "ok" if ok else "unavailable", "models": models}, status_code=200 if ok else 503)


@api.get("/metrics")
async def metrics(request: Request):
    st = _state(request)
    await anyio.to_thread.run_sync(st.metrics.refresh)
    return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# -- tokenizer (vLLM's shape, what lm-eval's remote tokenizer uses) ------------------------------
@api.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    router = _state(request).router
    tok = router.tokenizer
    template = getattr(tok, "chat_template", None)
    return {
        "tokenizer_class": type(tok).__name__,
        "eos_token": getattr(tok, "eos_token", None),
        "bos_token": getattr(tok, "bos_token", None),
        "pad_token": getattr(tok, "pad_token", None),
        "chat_template": template if isinstance(template, str) else None,
        "model_max_length": router.max_context,
    }


@api.post("/tokenize")
async def tokenize(request: Request):
    st = _state(request)
    data = await read_json(request, st.max_body_bytes)
    if not isinstance(data, dict):
        raise bad_request(None, "the body must be a JSON object with 'prompt' or 'messages'")
    router = st.router
    if isinstance(data.get("prompt"), str):
        ids = router.encode(data["prompt"], chat=False, add_special_tokens=bool(data.get("add_special_tokens", True)))
    elif isinstance(data.get("messages"), list) or isinstance(data.get("prompt"), list):
        messages = data.get("messages") or data.get("prompt")  # lm-eval's remote tokenizer sends chats as prompt
        if not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("messages", "'messages' must be a non-empty list of {'role', 'content'} objects")
        try:
            ids = router.encode(list(messages), chat_template_kwargs=data.get("chat_template_kwargs"))
        except Exception as e:  # noqa: BLE001 - the chat template refused them
            raise bad_request("messages", f"messages could not be rendered with the chat template: {e}") from None
    else:
        raise bad_request("prompt", "give 'prompt' (a string) or 'messages' (a list of chat messages)")
    return {"tokens": ids, "count": len(ids), "max_model_len": router.max_context}


@api.post("/detokenize")
async def detokenize(request: Request):
    st = _state(request)
    data = await read_json(request, st.max_body_bytes)
    ids = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise bad_request("tokens", "'tokens' must be a list of token ids")
    vocab = st.router.vocab_limit
    if any(not 0 <= i < vocab for i in ids):
        raise bad_request("tokens", f"'tokens' has ids outside the vocabulary [0, {vocab})")
    return {"prompt": st.router.tokenizer.decode(ids)}
