"""HTTP errors as OpenAI error objects: `{"error": {"message", "type", "param", "code"}}`.

    APIError                  any error this server reports on purpose
    ├── BadRequest (400)      invalid JSON or fields; context_length_exceeded
    ├── Unauthorized (401)    a missing or wrong API key
    ├── Forbidden (403)       the API key is not the admin key
    ├── NotFound (404)        unknown model or route
    ├── Conflict (409)        the model is in use (DELETE /v1/models/{id})
    ├── PayloadTooLarge (413)
    ├── TooManyRequests (429) waiting queue full; with Retry-After
    ├── RequestTimeout (504)  the request ran past request_timeout_s; it was aborted
    ├── InsufficientStorage (507) the memory guard refused; with the guard's numbers
    ├── (500) engine_step_failed: the step running this request raised; the cause is named
    └── ServiceUnavailable (503) the engine is not running; the memory probe is unavailable
                              (with Retry-After)

Every error carries a `code`: the one it was raised with, or its class's `default_code`.

Engine errors are translated here, at the boundary, so the engine never knows HTTP.
Every error answer goes through one `ErrorRenderer`, which picks the body's shape for the
request: OpenAI's by default, Anthropic's on the Anthropic routes (server/anthropic/errors.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Scope

from engine import (
    ContextLengthError,
    EngineDeadError,
    EngineStepError,
    InsufficientMemoryError,
    MemoryProbeUnavailableError,
    QueueFullError,
)
from memory import ProbeUnavailableError

log = logging.getLogger("mlx_headroom.server")


class APIError(Exception):
    status = 500
    type = "server_error"
    default_code = "server_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
                **self.extra,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class BadRequest(APIError):
    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class Unauthorized(APIError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class Forbidden(APIError):
    status = 403
    type = "permission_error"
    default_code = "forbidden"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class Conflict(APIError):
    status = 409
    type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class TooManyRequests(APIError):
    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class RequestTimeout(APIError):
    status = 504
    type = "timeout_error"
    default_code = "request_timeout"


class InsufficientStorage(APIError):
    status = 507
    type = "insufficient_memory"
    default_code = "insufficient_memory"


class ServiceUnavailable(APIError):
    status = 503
    type = "service_unavailable"
    default_code = "service_unavailable"


ErrorRenderer = Callable[[APIError, Scope], Response]
"""Turns an error into the response for one request; the request decides the shape."""


def openai_response(err: APIError, scope: Scope) -> Response:
    return err.response()


def from_engine_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InsufficientMemoryError):
        headers = (
            {"Retry-After": str(exc.retry_after_s), "x-should-retry": "true"}
            if exc.retryable
            else {"x-should-retry": "false"}
        )
        return InsufficientStorage(exc.args[0], code=exc.code, headers=headers, extra=exc.details())
    if isinstance(exc, QueueFullError):
        return TooManyRequests(str(exc), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, ContextLengthError):
        return BadRequest(str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, (MemoryProbeUnavailableError, ProbeUnavailableError)):
        return ServiceUnavailable(
            str(exc), code="memory_probe_unavailable",
            headers={"Retry-After": str(exc.retry_after_s), "x-should-retry": "true"},
        )
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailable(str(exc), code="engine_unavailable")
    if isinstance(exc, EngineStepError):
        return APIError(str(exc), code="engine_step_failed")
    log.exception("unexpected error", exc_info=exc)
    return APIError("internal error; the server keeps running", code="internal_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    where = f" at '{param}'" if param else ""
    return f"invalid request{where}: {first.get('msg')}", param


def install_error_handlers(app: FastAPI, render: ErrorRenderer = openai_response) -> None:
    def answer(request: Request, err: APIError) -> Response:
        request.state.error = err  # for the access log
        return render(err, request.scope)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return answer(request, exc)

    @app.exception_handler(ProbeUnavailableError)
    async def probe_unavailable(request: Request, exc: ProbeUnavailableError) -> JSONResponse:
        return answer(request, from_engine_error(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return answer(request, BadRequest(message, code="invalid_request", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        cls = {404: NotFound, 401: Unauthorized, 413: PayloadTooLarge}.get(exc.status_code)
        if cls is None:
            err = APIError(str(exc.detail), code=f"http_{exc.status_code}")
            err.status = exc.status_code
            err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        else:
            err = cls(str(exc.detail), code=f"http_{exc.status_code}")
        return answer(request, err)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        return answer(request, from_engine_error(exc))
