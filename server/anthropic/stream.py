"""A message as Anthropic's server-sent events, each an `event:` line and a `data:` line.

The documented order: `message_start`, then per content block `content_block_start`,
`content_block_delta`s and `content_block_stop` (a `ping` follows the first block's start),
then `message_delta` with the stop reason and the final usage, then `message_stop`. An
error after the 200 has gone out arrives as an `error` event.

`message_start` carries the whole prompt as `input_tokens`: the prefix cache's share is
known only when the request finishes, so `message_delta` restates `input_tokens` and
`cache_read_input_tokens`, which the SDKs take as the final counts. The accumulated
message then equals the non-streamed one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from server.anthropic.errors import error_body
from server.anthropic.message import message_shell, stop_fields, usage
from server.errors import APIError
from server.generation import Generation


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _events(generation: Generation, first: Any) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for event in generation.rest():
        yield event


async def message_events(generation: Generation, first: Any, model: str) -> AsyncIterator[bytes]:
    """The events of a generation whose first event (or end) has arrived; closing aborts it."""
    try:
        start = message_shell(generation, model)
        start["usage"] = {**usage(generation), "input_tokens": len(generation.prepared.prompt_tokens),
                          "cache_read_input_tokens": 0}
        yield sse("message_start", {"type": "message_start", "message": start})
        yield sse("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}})
        yield sse("ping", {"type": "ping"})
        async for _, delta, _ in _events(generation, first):
            if delta.text:
                yield sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                  "delta": {"type": "text_delta", "text": delta.text}})
        yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield sse("message_delta", {"type": "message_delta", "delta": stop_fields(generation),
                                    "usage": usage(generation)})
        yield sse("message_stop", {"type": "message_stop"})
    except APIError as exc:
        yield sse("error", error_body(exc))
    finally:
        generation.close()
