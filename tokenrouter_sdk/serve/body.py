"""Reading a request body with a size limit, then decoding it as JSON: a body over the limit is
refused from its Content-Length header (or, without one, as soon as the bytes read pass the
limit) before anything is parsed."""

from __future__ import annotations

import json

from .errors import APIError, bad_request


def too_large(limit: int, size: int | None = None) -> APIError:
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return APIError(
        413,
        f"the request body is {got}; the limit is {limit} bytes (tokenrouter serve "
        f"--max-body-mb): send a shorter prompt",
        None,
        "request_too_large",
    )


async def read_json(request, limit: int):
    """The decoded JSON body of ``request``.

    Raises:
        APIError: 413 the body is larger than ``limit`` bytes; 400 the body is empty or not
            valid JSON (names the position).
    """
    length = request.headers.get("content-length")
    if length is not None:
        try:
            size = int(length)
        except ValueError:
            raise bad_request(None, f"bad Content-Length header {length!r}") from None
        if size > limit:
            raise too_large(limit, size)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request(None, 'the request body is empty: send a JSON object, e.g. {"prompt": "Hi"}')
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise bad_request(
            None,
            f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; send a JSON object",
            "invalid_json",
        ) from None
    except UnicodeDecodeError:
        raise bad_request(None, "the request body is not UTF-8 text: send a JSON object", "invalid_json") from None
