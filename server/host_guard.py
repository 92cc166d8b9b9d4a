"""Host and Origin checks: a web page must not be able to drive this server.

Two attacks reach a server bound to 127.0.0.1 from a browser:

- **DNS rebinding.** A page's own hostname first resolves to its server and then to
  127.0.0.1, so the browser treats our answers as same-origin and lets the page read and
  write freely. Its requests still carry the attacker's name in ``Host``, so every request
  (the dashboard included) must name a host this server is known by: ``localhost``,
  ``127.0.0.1``, ``[::1]``, the bound address, or one given with ``--allowed-host``.
- **Cross-site requests.** A page elsewhere can send a POST to ``http://127.0.0.1:8000``
  without reading the answer. Browsers mark such a request with ``Origin``; a mutating
  request whose Origin is neither the server's own nor one allowed by ``--cors-origin`` is
  refused. Requests without ``Origin`` (curl, the SDKs, services) are not browsers'
  cross-site requests and pass. A ``text/plain`` or form body never reaches a route as
  JSON (400), which is the second lock on the same door.

Both refusals are 403 OpenAI error objects naming the setting to change. The port is not
part of the Host check: a Host with our name cannot come from a rebinding page, whatever
port the browser used (a reverse proxy often forwards its own).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import ErrorRenderer, Forbidden, openai_response

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
ANY = "*"


def split_host(value: str) -> tuple[str, int | None]:
    """`Host` (or an allowed-host entry) as (canonical name, port or None).

    Names are lower-cased, IPv6 literals lose their brackets and IP addresses take their
    compressed form, so ``[0:0:0:0:0:0:0:1]:80`` and ``[::1]`` name the same host. An
    unparseable port leaves the whole value as the name, which then matches nothing.
    """
    text = value.strip().lower()
    name, port = text, None
    if text.startswith("["):
        end = text.find("]")
        if end > 0:
            name, rest = text[1:end], text[end + 1:]
            if rest.startswith(":") and rest[1:].isdigit():
                port = int(rest[1:])
            elif rest:
                return text, None
    elif text.count(":") == 1:
        head, _, tail = text.partition(":")
        if tail.isdigit():
            name, port = head, int(tail)
    try:
        name = ipaddress.ip_address(name).compressed
    except ValueError:
        name = name.rstrip(".")  # "localhost." is the same name, fully qualified
    return name, port


@dataclass(frozen=True)
class HostPolicy:
    """The names this server answers to, and the origins allowed to change things."""

    names: frozenset[str]
    proxied_names: frozenset[str]  # the --allowed-host names: a page there is ours, any port
    any_host: bool
    cors_origins: frozenset[str]
    any_origin: bool

    @classmethod
    def build(cls, *, bind_host: str, allowed_hosts: Iterable[str],
              cors_origins: Iterable[str]) -> HostPolicy:
        allowed = [h.strip() for h in allowed_hosts if h.strip()]
        names = {split_host(h)[0] for h in (*LOOPBACK_NAMES, bind_host, *allowed) if h != ANY}
        proxied = {split_host(h)[0] for h in allowed if h != ANY}
        origins = {o.strip().rstrip("/").lower() for o in cors_origins if o.strip()}
        return cls(names=frozenset(names), proxied_names=frozenset(proxied), any_host=ANY in allowed,
                   cors_origins=frozenset(origins - {ANY}), any_origin=ANY in origins)

    def host_allowed(self, host: str | None) -> bool:
        # A request without Host is HTTP/1.0 from a tool; browsers always send one.
        if self.any_host or host is None:
            return True
        return split_host(host)[0] in self.names

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        """Same origin as the request (scheme aside, for a TLS proxy), a page on a name
        given with --allowed-host (a proxy may forward a Host of its own), or a CORS origin.
        A page on localhost at another port is another application, and is refused."""
        normalized = origin.strip().rstrip("/").lower()
        if self.any_origin or normalized in self.cors_origins:
            return True
        parts = urlsplit(normalized)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (sandboxed frames, file://) is nobody's own origin
        if split_host(parts.netloc)[0] in self.proxied_names:
            return True
        return host is not None and _with_port(parts.scheme, parts.netloc) == _with_port(parts.scheme, host)


def _with_port(scheme: str, netloc: str) -> tuple[str, int]:
    """(name, port) with the scheme's default port filled in, as browsers leave it out."""
    name, port = split_host(netloc)
    return name, port if port is not None else (443 if scheme == "https" else 80)


def host_refused(host: str) -> Forbidden:
    return Forbidden(
        f"this server does not answer to the host {host!r}. If that is a name you use for it "
        "(a LAN name, a reverse proxy), add it with --allowed-host (MLX_HEADROOM_ALLOWED_HOSTS).",
        code="host_not_allowed",
    )


def origin_refused(origin: str) -> Forbidden:
    return Forbidden(
        f"requests from the web origin {origin!r} may not change anything here. To allow a web "
        "app there, add it with --cors-origin (MLX_HEADROOM_CORS_ORIGINS).",
        code="origin_not_allowed",
    )


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


class HostGuardMiddleware:
    """Refuses foreign Hosts on every route and foreign Origins on mutating requests."""

    def __init__(self, app: ASGIApp, *, policy: HostPolicy,
                 render: ErrorRenderer = openai_response) -> None:
        self.app = app
        self.policy = policy
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = _header(scope, b"host")
            error: Forbidden | None = None
            if not self.policy.host_allowed(host):
                error = host_refused(host or "")
            elif scope.get("method", "GET") not in SAFE_METHODS:
                origin = _header(scope, b"origin")
                if origin is not None and not self.policy.origin_allowed(origin, host):
                    error = origin_refused(origin)
            if error is not None:
                scope.setdefault("state", {})["error"] = error
                await self.render(error, scope)(scope, receive, send)
                return
        await self.app(scope, receive, send)
