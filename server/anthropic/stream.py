"""A message as Anthropic's server-sent events, each an `event:` line and a `data:` line.

The documented order: `message_start`, a `ping`, then per content block
`content_block_start`, `content_block_delta`s (`text_delta`, `thinking_delta`, or
`input_json_delta` for a tool's input) and `content_block_stop`, then `message_delta` with
the stop reason and the final usage, then `message_stop`. Blocks open as their content
arrives (blocks.py), so a message that is only a tool call has no empty text block before
it, as when whole. An error after the 200 has gone out arrives as an `error` event.

`message_start` carries the whole prompt as `input_tokens`: the prefix cache's share is
known only when the request finishes, so `message_delta` restates `input_tokens` and
`cache_read_input_tokens`, which the SDKs take as the final counts. The accumulated
message then equals the non-streamed one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from server import fastjson
from server.anthropic.blocks import BlockStream
from server.anthropic.errors import error_body
from server.anthropic.message import message_shell, stop_fields, usage
from server.errors import APIError
from server.generation import Generation
from server.reasoning import TextParser


def sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + fastjson.dumps(data) + b"\n\n"


async def _events(generation: Generation, first: Any) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for event in generation.rest():
        yield event


async def message_events(
    generation: Generation, first: Any, model: str, parser: TextParser | None, *,
    thinking: bool = False,
) -> AsyncIterator[bytes]:
    """The events of a generation whose first event (or end) has arrived; closing aborts it."""
    blocks = BlockStream(parser, thinking)
    try:
        start = message_shell(generation, model)
        start["usage"] = {**usage(generation), "input_tokens": len(generation.prepared.prompt_tokens),
                          "cache_read_input_tokens": 0, "output_tokens": 0}
        yield sse("message_start", {"type": "message_start", "message": start})
        yield sse("ping", {"type": "ping"})
        async for _, delta, finish in _events(generation, first):
            for event, data in blocks.feed(delta.text, final=finish is not None):
                yield sse(event, data)
        yield sse("message_delta", {"type": "message_delta",
                                    "delta": stop_fields(generation, tool_use=blocks.calls > 0),
                                    "usage": usage(generation)})
        yield sse("message_stop", {"type": "message_stop"})
    except APIError as exc:
        yield sse("error", error_body(exc))
    finally:
        generation.close()
