"""Generated text -> Anthropic content blocks (`thinking`, `text`, `tool_use`), whole or as
it streams.

The shared parser (server/tools.py) reports what the model writes as ordered events:
content text, a call's start (id and name), fragments of its arguments' JSON, its end.
Both answers are built from those events, so a streamed message and a whole one have the
same blocks in the same order: each run of text is a `text` block, each call a `tool_use`
block whose input streams as `input_json_delta` fragments while it is generated. The
fragments joined are the arguments as written, so the SDKs' partial-JSON accumulation
ends at the whole message's `input`.

The model's thinking (server/reasoning.py) becomes `thinking` blocks, streamed as
`thinking_delta`s, when the request enabled thinking (`thinking: {"type": "enabled"}` or
`"adaptive"`); otherwise it is dropped, as Anthropic's models do not think then. A thinking
block's `signature` is empty: this server signs nothing, and thinking blocks sent back in
the history are dropped (convert.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic_core import from_json

from server.reasoning import OutputEvent, ReasoningText, TextParser
from server.tools import ArgumentsDelta, CallDone, CallStarted, ContentText, ToolCallParser

Event = tuple[str, dict[str, Any]]


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a call: unique as the parser's, in Anthropic's spelling."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """The input object. A call cut off by max_tokens is read as far as it goes, the way
    the SDKs read streamed partial JSON (incomplete strings are left out)."""
    try:
        value = from_json(arguments, allow_partial=True) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def parse_events(parser: TextParser | ToolCallParser | None, text: str, *,
                 final: bool) -> list[OutputEvent]:
    if parser is None:
        return [ContentText(text)] if text else []
    piece = parser.feed(text)
    if final:
        piece.extend(parser.finish())  # type: ignore[arg-type]
    return list(piece.events)


@dataclass
class BlockStream:
    """Turns parser events into Anthropic's block events, opening blocks as content arrives.

    `feed` returns (event name, payload) pairs: content_block_start / _delta / _stop.
    """

    parser: TextParser | ToolCallParser | None
    thinking: bool = False  # the request enabled thinking: reasoning becomes thinking blocks
    calls: int = 0
    _events: list[Event] = field(default_factory=list)
    _next: int = 0
    _open: int | None = None  # index of the open block
    _open_kind: str = ""

    def feed(self, text: str, *, final: bool = False) -> list[Event]:
        self._events = []
        for event in parse_events(self.parser, text, final=final):
            if isinstance(event, ReasoningText):
                if self.thinking:
                    if self._open_kind != "thinking":
                        self._start({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
                    self._delta({"type": "thinking_delta", "thinking": event.text})
            elif isinstance(event, ContentText):
                if self._open_kind != "text":
                    self._start({"type": "text", "text": ""}, "text")
                self._delta({"type": "text_delta", "text": event.text})
            elif isinstance(event, CallStarted):
                self.calls += 1
                self._start({"type": "tool_use", "id": tool_use_id(event.call_id), "name": event.name,
                             "input": {}}, "tool")
            elif isinstance(event, ArgumentsDelta):
                self._delta({"type": "input_json_delta", "partial_json": event.delta})
            elif isinstance(event, CallDone):
                self._stop()
        if final:
            self._stop()
            if self._next == 0:  # nothing was said: one empty text block, as when whole
                self._start({"type": "text", "text": ""}, "text")
                self._stop()
        return self._events

    def _start(self, block: dict[str, Any], kind: str) -> None:
        self._stop()
        self._open, self._open_kind = self._next, kind
        self._next += 1
        self._events.append(("content_block_start",
                             {"type": "content_block_start", "index": self._open, "content_block": block}))

    def _delta(self, delta: dict[str, Any]) -> None:
        self._events.append(("content_block_delta",
                             {"type": "content_block_delta", "index": self._open, "delta": delta}))

    def _stop(self) -> None:
        if self._open is not None:
            self._events.append(("content_block_stop", {"type": "content_block_stop", "index": self._open}))
        self._open, self._open_kind = None, ""


def whole_content(events: list[Event]) -> list[dict[str, Any]]:
    """The content of a whole message: the blocks the same events stream."""
    blocks: list[dict[str, Any]] = []
    arguments: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            delta = data["delta"]
            if delta["type"] == "text_delta":
                blocks[data["index"]]["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                blocks[data["index"]]["thinking"] += delta["thinking"]
            else:
                arguments[data["index"]] = arguments.get(data["index"], "") + delta["partial_json"]
    for index, text in arguments.items():
        blocks[index]["input"] = tool_input(text)
    return blocks
