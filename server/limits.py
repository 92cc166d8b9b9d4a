"""The request body limit, checked from Content-Length and again while the body streams in.

A client that sends no Content-Length (chunked) or a false one cannot get past it: the
bytes are counted as they arrive, and the request is answered 413 the moment they pass
the limit; the route then sees a disconnect and whatever it answers is dropped.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import ErrorRenderer, PayloadTooLarge, openai_response


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
    )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int,
                 render: ErrorRenderer = openai_response) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await self._refuse(scope, receive, send)
            return

        received = 0
        refused = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    refused = True
                    if not started:
                        await self._refuse(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 has been sent; the route's answer goes nowhere
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not refused:
                raise

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = _too_large(self.limit)
        scope.setdefault("state", {})["error"] = error
        response = self.render(error, scope)
        response.headers["Connection"] = "close"
        await response(scope, receive, send)
