"""One access line per request, written like every log line as JSON (`engine.logs`).

The access line (logger `mlx_headroom.access`) carries the request id, method, path,
status, token counts, time to first token, total time and the admission outcome. It
never carries prompt or completion text unless `log_prompts` is set.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, InsufficientStorage, RequestTimeout, TooManyRequests

access_log = logging.getLogger("mlx_headroom.access")


def admission_outcome(generation: Any, error: APIError | None) -> str | None:
    """What became of the request at the engine's door; None for requests that never knock."""
    if isinstance(error, InsufficientStorage):
        return f"rejected:{error.code}"
    if isinstance(error, TooManyRequests):
        return error.code or "queue_full"
    if generation is None:
        return None
    if isinstance(error, RequestTimeout):
        return "admitted" if generation.first_token_at is not None else "timeout"
    return "admitted"


class AccessLogMiddleware:
    """Times every request, logs its line, and hands the same record to `observe` (metrics)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        log_prompts: bool,
        observe: Callable[[dict[str, Any], Any], None] | None = None,
    ) -> None:
        self.app = app
        self.log_prompts = log_prompts
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        state: dict[str, Any] = scope.setdefault("state", {})
        status = 500
        fallback_id = uuid.uuid4().hex[:24]

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                generation = state.get("generation")
                request_id = generation.id if generation is not None else fallback_id
                message = {**message, "headers": [
                    *message.get("headers", []), (b"x-request-id", request_id.encode())
                ]}
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self._log(scope, state, status, started, fallback_id)

    def _log(self, scope: Scope, state: dict[str, Any], status: int, started: float,
             fallback_id: str) -> None:
        generation = state.get("generation")
        error: APIError | None = state.get("error")
        if generation is not None and generation.error is not None:
            error = generation.error
        record: dict[str, Any] = {
            "request_id": generation.id if generation is not None else fallback_id,
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "prompt_tokens": None,
            "completion_tokens": None,
            "ttft_s": None,
            "total_s": round(time.monotonic() - started, 6),
            "admission": admission_outcome(generation, error),
            "error_code": error.code if error is not None else None,
        }
        if generation is not None:
            usage = generation.usage()
            record["prompt_tokens"] = usage["prompt_tokens"]
            record["completion_tokens"] = usage["completion_tokens"]
            if generation.first_token_at is not None:
                record["ttft_s"] = round(generation.first_token_at - started, 6)
            if self.log_prompts:
                record["prompt"] = generation.tokenizer.decode(list(generation.prepared.prompt_tokens))
                record["completion"] = [c.text.text for c in generation.choices]
        if self.observe is not None:
            self.observe(record, scope)
        access_log.info("request", extra=record)
