"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx or 5xx
status. Every error the server returns goes through `APIError`; the handlers below turn
FastAPI's own errors (unknown route, wrong method, anything unexpected) into the same shape. A
5xx (a failed request: a policy error, a dead sub-server) is also logged as a warning on
``tokenrouter.serve``, so the server's log shows what its clients were told."""

from __future__ import annotations

import logging

log = logging.getLogger("tokenrouter.serve")

TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered to the client.

    Args:
        status: HTTP status (400 bad input, 404 unknown model, 413 body too large, 500 a policy
            or the engine failed the request, 503 the engine cannot serve).
        message: what is wrong and how to fix it.
        param: the request field at fault (e.g. ``"max_tokens"``), or None.
        code: a short machine-readable code (e.g. ``"model_not_found"``), or None.
        type: the OpenAI error type (default from the status).
    """

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, message, param, code)


def install_handlers(app) -> None:
    """Answer `APIError`, Starlette's HTTP errors (404 unknown path, 405 wrong method) and any
    other exception in the OpenAI error shape."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def api_error(request, exc: APIError):
        if exc.status >= 500:  # the server's fault, not the client's: the operator sees it in the log
            log.warning("%s %s answered %d: %s", request.method, request.url.path, exc.status, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(request, exc: HTTPException):
        msg = {
            404: f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/completions, "
            f"POST /v1/chat/completions, GET /health, GET /metrics",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return JSONResponse(
            APIError(exc.status_code, msg, None, None).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def validation_error(request, exc: RequestValidationError):
        err = (exc.errors() or [{}])[0]
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        return JSONResponse(
            bad_request(loc or None, f"{loc or 'request'}: {err.get('msg', 'invalid')}").body(), status_code=400
        )

    async def unexpected(request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
