"""Errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

The server raises the same `APIError`s on every route (server/errors.py); this module only
decides how they look to an Anthropic client. A request gets Anthropic's shape when it is
for an Anthropic route (`/v1/messages...`) or carries `anthropic-version`, whatever raised
the error: a route, validation, the auth or body-limit middleware, or an unknown path.

Statuses are Anthropic's (400, 401, 403, 404, 413, 429, 500, 504, 529) with two of ours:

- 507 `insufficient_memory`: the memory guard refused a request that can never fit under
  the current ceiling. It keeps our status and the guard's numbers (`estimated_bytes`,
  `limit_bytes`, `binding`, `code`), with `x-should-retry: false`, which the anthropic
  SDKs obey: retrying the same request cannot help.
- A request that waited for memory and timed out could fit once other work finishes. That
  is what Anthropic's 529 `overloaded_error` means to its clients ("temporarily
  overloaded, retry"), so it answers 529 with `Retry-After` and `x-should-retry: true`, and
  Claude Code shows it and retries as it does for Anthropic's own overloads. The numbers
  come along as in the 507.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import Scope

from server.errors import APIError, InsufficientStorage

ANTHROPIC_PATH = "/v1/messages"

TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OVERLOADED = 529


def wants_anthropic_shape(scope: Scope) -> bool:
    path: str = scope.get("path", "")
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return True
    return any(name == b"anthropic-version" for name, _ in scope.get("headers", ()))


def status_and_type(err: APIError) -> tuple[int, str]:
    if isinstance(err, InsufficientStorage):
        if err.headers.get("x-should-retry") == "true":
            return OVERLOADED, TYPES[OVERLOADED]
        return err.status, err.type
    if err.status in TYPES:
        return err.status, TYPES[err.status]
    return err.status, "invalid_request_error" if err.status < 500 else "api_error"


def error_body(err: APIError) -> dict[str, Any]:
    """The error object; our `code` and any numbers ride along beside type and message."""
    _, kind = status_and_type(err)
    details: dict[str, Any] = {"code": err.code} if err.code else {}
    return {"type": "error", "error": {"type": kind, "message": err.message, **details, **err.extra}}


def anthropic_response(err: APIError) -> JSONResponse:
    status, _ = status_and_type(err)
    return JSONResponse(error_body(err), status_code=status, headers=err.headers)


def render(err: APIError, scope: Scope) -> Response:
    """The server's ErrorRenderer: Anthropic's shape where the request wants it."""
    return anthropic_response(err) if wants_anthropic_shape(scope) else err.response()
