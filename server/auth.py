"""API keys: one ASGI middleware in front of every route, so a new route cannot forget it.

Default deny: every path needs the API key except `/health` and the dashboard's static
files (they hold no data; the page sends the key it is given). A mutating request
(anything but GET, HEAD, OPTIONS) outside the inference routes is an admin request; it
needs the admin key when one is set, and the API key covers admin when none is.

The key is read from `Authorization: Bearer <key>` or, as Anthropic's clients send it,
`x-api-key: <key>`.

    no key set          everything is open (refused at start on a non-loopback address)
    missing/wrong key   401 authentication_error, WWW-Authenticate: Bearer
    API key on admin    403 permission_error (only when an admin key is set)
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError, ErrorRenderer, Forbidden, Unauthorized, openai_response
from server.settings import Settings

OPEN_PATHS = frozenset({"/health"})
OPEN_PREFIXES = ("/dashboard/",)
INFERENCE_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/responses",
})
# A client's own stored responses (GET/DELETE /v1/responses/{id}) are not admin business.
INFERENCE_PREFIXES = ("/v1/responses/",)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path == "/dashboard" or path.startswith(OPEN_PREFIXES)


def is_admin(method: str, path: str) -> bool:
    return (method not in SAFE_METHODS and path not in INFERENCE_PATHS
            and not path.startswith(INFERENCE_PREFIXES))


def _matches(given: str | None, key: str | None) -> bool:
    if given is None or key is None:
        return False
    return hmac.compare_digest(given.encode(), key.encode())


def bearer_token(scope: Scope) -> str | None:
    """The key the request presents: a Bearer token, else an `x-api-key` header."""
    api_key = None
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
        elif name == b"x-api-key":
            api_key = value.decode("latin-1").strip()
    return api_key


def check(method: str, path: str, token: str | None, *, api_key: str | None,
          admin_key: str | None) -> APIError | None:
    """None when the request may pass; otherwise the error to answer with."""
    if is_open(path) or (api_key is None and admin_key is None):
        return None
    if is_admin(method, path):
        if _matches(token, admin_key or api_key):
            return None
        if admin_key is not None and _matches(token, api_key):
            return Forbidden("this route needs the admin key", code="admin_key_required")
    elif _matches(token, api_key) or _matches(token, admin_key):
        return None
    detail = "missing API key" if token is None else "incorrect API key"
    return Unauthorized(
        f"{detail}; send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
    )


class AuthMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, admin_key: str | None,
                 render: ErrorRenderer = openai_response) -> None:
        self.app = app
        self.api_key = api_key or None
        self.admin_key = admin_key or None
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = check(scope["method"], scope["path"], bearer_token(scope),
                          api_key=self.api_key, admin_key=self.admin_key)
            if error is not None:
                scope.setdefault("state", {})["error"] = error
                await self.render(error, scope)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def startup_problem(settings: Settings) -> str | None:
    """Why the server must not start as configured, or None."""
    if settings.api_key or settings.admin_key or settings.allow_unauthenticated:
        return None
    if is_loopback(settings.host):
        return None
    return (
        f"refusing to serve on {settings.host} without an API key: anyone who can reach it "
        "could use it. Set --api-key (MLX_HEADROOM_API_KEY), or pass --allow-unauthenticated "
        "if something in front of this server already checks who may call it."
    )
