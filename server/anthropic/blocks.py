"""Generated text -> Anthropic content blocks (`text`, `tool_use`), whole or as it streams.

Tool calls are found by the shared parser of server/tools.py. While a call is being
generated, its arguments stream as `input_json_delta` fragments of the raw JSON the model
writes: once `{"name": ..., "arguments": ` has gone by, everything after it is arguments,
except a held-back tail that may still turn out to be the call's closing brace or end
marker. When the call ends, the rest of its arguments follows. The fragments joined are
the arguments as generated, so the SDKs' partial-JSON accumulation ends at the same
`input` as the non-streamed message.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.tools import ToolCall, ToolCallParser, _partial_suffix

log = logging.getLogger("mlx_headroom.anthropic")

# The head of a Hermes-style call body: `{"name": "...", "arguments": ` (any whitespace).
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')

Event = tuple[str, dict[str, Any]]


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def tool_input(call: ToolCall) -> dict[str, Any] | None:
    """The call's arguments as an object, or None when the model wrote something else."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def whole_content(text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The content of a finished message: its text, then its calls."""
    blocks: list[dict[str, Any]] = []
    for call in calls:
        value = tool_input(call)
        if value is None:
            text += call.arguments  # not an object, so not a tool_use: keep it as text
        else:
            blocks.append({"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": value})
    if text or not blocks:
        blocks.insert(0, {"type": "text", "text": text})
    return blocks


def _raw_arguments(body: str) -> str | None:
    """The arguments' JSON text inside a complete call body, as the model wrote it."""
    head = _CALL_HEAD.match(body)
    if head is None:
        return None
    rest = body[head.end():].rstrip()
    return rest[:-1] if rest.endswith("}") else None


@dataclass
class _OpenTool:
    index: int
    sent: str = ""  # argument text already streamed


@dataclass
class BlockStream:
    """Feeds text deltas through the tool parser; says which block events to send.

    `feed` returns (event name, payload) pairs: content_block_start / _delta / _stop.
    """

    parser: ToolCallParser | None
    calls: int = 0
    _events: list[Event] = field(default_factory=list)
    _next: int = 0
    _text: int | None = None  # index of the open text block
    _tool: _OpenTool | None = None

    def feed(self, text: str, *, final: bool = False) -> list[Event]:
        self._events = []
        if self.parser is None:
            self._say_text(text)
        else:
            before = self.parser.pending_call
            piece = self.parser.feed(text)
            if final:
                tail = self.parser.finish()
                piece.text += tail.text
                piece.calls += tail.calls
            if before is None:  # text can only precede the calls
                self._say_text(piece.text)
            for i, call in enumerate(piece.calls):
                streamed = before is not None and i == 0 and self._tool is not None
                self._finish_call(call, before + text if streamed and before is not None else None)
            if before is not None:  # we were inside a call: any text follows it
                self._say_text(piece.text)
            if not final:
                self._stream_pending()
        if final:
            self._close()
            if self._next == 0:  # nothing was said: one empty text block, as when whole
                self._text = self._open({"type": "text", "text": ""})
                self._close()
        return self._events

    def _say_text(self, text: str) -> None:
        if not text:
            return
        if self._text is None:
            self._close()
            self._text = self._open({"type": "text", "text": ""})
        self._delta(self._text, {"type": "text_delta", "text": text})

    def _stream_pending(self) -> None:
        assert self.parser is not None
        body = self.parser.pending_call
        if body is None or (head := _CALL_HEAD.match(body)) is None:
            return
        if self._tool is None:
            self._close()
            name = json.loads(f'"{head.group(1)}"')
            self._tool = _OpenTool(self._open(
                {"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}}))
        arguments = body[head.end():]
        arguments = arguments[:len(arguments) - _partial_suffix(arguments, self.parser.syntax.end)]
        self._send_arguments(arguments.rstrip()[:-1])  # the last character may close the call

    def _finish_call(self, call: ToolCall, raw_buffer: str | None) -> None:
        """A call has ended; `raw_buffer` holds its raw body (and more) if it was streaming."""
        value = tool_input(call)
        if value is None:
            self._say_text(call.arguments)
            return
        self.calls += 1
        if raw_buffer is not None and self._tool is not None:
            assert self.parser is not None
            end = raw_buffer.find(self.parser.syntax.end)
            raw = _raw_arguments(raw_buffer[:end] if end >= 0 else raw_buffer)
            if raw is not None and raw.startswith(self._tool.sent):
                self._send_arguments(raw)
            else:  # cannot happen with Hermes JSON; the input would be incomplete
                log.warning("a streamed tool call's arguments could not be completed")
            self._close()
            return
        self._close()
        index = self._open({"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": {}})
        self._tool = _OpenTool(index)
        self._send_arguments(call.arguments)
        self._close()

    def _send_arguments(self, upto: str) -> None:
        tool = self._tool
        assert tool is not None
        if len(upto) > len(tool.sent) and upto.startswith(tool.sent):
            self._delta(tool.index, {"type": "input_json_delta", "partial_json": upto[len(tool.sent):]})
            tool.sent = upto

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        self._events.append(("content_block_delta",
                             {"type": "content_block_delta", "index": index, "delta": delta}))

    def _open(self, block: dict[str, Any]) -> int:
        index = self._next
        self._next += 1
        self._events.append(("content_block_start",
                             {"type": "content_block_start", "index": index, "content_block": block}))
        return index

    def _close(self) -> None:
        open_index = self._text if self._text is not None else (self._tool.index if self._tool else None)
        if open_index is not None:
            self._events.append(("content_block_stop", {"type": "content_block_stop", "index": open_index}))
        self._text = None
        self._tool = None
