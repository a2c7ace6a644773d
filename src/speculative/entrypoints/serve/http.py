"""The HTTP side of the server, apart from the routes: the access log, API keys, request
bodies within their limit, and every error as OpenAI's {"error": {...}} object."""

from __future__ import annotations

import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .errors import APIError, invalid
from .protocol import parse_json

access_log = logging.getLogger("speculative.serve.access")


def install_error_handlers(app: FastAPI) -> None:
    """Ours (APIError), the framework's (404, 405, validation) and anything unexpected (500)."""
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, server_error)


async def api_error(request, error: APIError):
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None  # seconds
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def http_error(request, error: HTTPException):
    what = {404: f"no route {request.method} {request.url.path}: see /v1/completions, /v1/chat/completions, "
                 "/v1/models, /health, /metrics",
            405: f"method {request.method} is not allowed on {request.url.path}"}.get(error.status_code,
                                                                                    str(error.detail))
    return await api_error(request, APIError(error.status_code, what, code={404: "not_found"}.get(error.status_code)))


async def validation_error(request, error):
    return await api_error(request, invalid(None, str(error)))


async def server_error(request, error):
    return await api_error(request, APIError(500, f"{type(error).__name__}: {error}"))


def authorize(request: Request, api_key: str | None) -> None:
    """'Authorization: Bearer KEY' when the server has a key, compared in constant time."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer KEY'",
                       code="invalid_api_key")


async def read_body(request: Request, limit: int) -> dict:
    """The JSON object of the body, refused with 413 past `limit` bytes (declared or sent)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body has {int(length)} bytes, more than the limit of {limit}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


class AccessLog:
    """ASGI middleware: one line per HTTP request once its response is sent (or its client
    gone): method, path, status, tokens (prompt + completion) and seconds."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [None]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            status[0] = status[0] or 500  # answered by the server-error handler, outside this middleware
            raise
        finally:
            usage = scope.get("state", {}).get("usage")
            tokens = ""
            if usage is not None:
                counts = usage()
                tokens = f" tokens {counts['prompt_tokens']}+{counts['completion_tokens']}"
            client = scope.get("client") or ("-", 0)
            access_log.info('%s:%s "%s %s" %s%s %.3f s', client[0], client[1], scope["method"], scope["path"],
                            status[0] or "-", tokens, time.perf_counter() - started)
