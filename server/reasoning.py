"""Reasoning apart from the answer: generated text split at the model's own think markers.

Reasoning models write their thinking between markers that mlx-lm's tokenizer names
(`has_thinking`, `think_start`, `think_end`: `<think>`/`</think>` for Qwen3 and the
DeepSeek-R1 distills, Gemma's and others' where mlx-lm knows them). A template may open
the block itself (Qwen3's thinking models, the R1 distills end the generation prompt with
`<think>`): such a prompt starts the output in reasoning (`opens_in_reasoning`).

`OutputParser` is what every API reads a choice's text through, streamed or whole: it
releases `ReasoningText` for the thinking and hands everything else to the model family's
tool-call parser (server/tools.py), whose `ContentText` and call events follow unchanged.
A call marker inside reasoning ends the reasoning (models that call a tool without
closing the block), so the call is parsed as any other. Markers never reach the client;
a partial marker at the end of a piece is held back until it is clearly not one. The
whitespace around a marker (`<think>\\n`, `\\n</think>\\n\\n`) is layout, not text.

The APIs map the events: chat completions' `reasoning_content`, the Responses API's
`reasoning` items, Anthropic's `thinking` blocks (dropped when the request did not enable
thinking).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from server.tools import ContentText, ParseEvent, ToolCall, ToolCallParser

# How far back from the prompt's end an opening marker is looked for: a template opens the
# block in its generation prompt, a few tokens from the end.
_PROMPT_TAIL = 32


@dataclass(frozen=True)
class ThinkMarkers:
    start: str
    end: str

    @staticmethod
    def for_tokenizer(tokenizer: Any) -> ThinkMarkers | None:
        """The markers mlx-lm found in the tokenizer's vocabulary, or None."""
        if not getattr(tokenizer, "has_thinking", False):
            return None
        start, end = tokenizer.think_start, tokenizer.think_end
        return ThinkMarkers(start, end) if start and end else None


def opens_in_reasoning(tokenizer: Any, prompt: list[int]) -> bool:
    """Whether the prompt ends inside a thinking block that its template opened."""
    tail = max(len(prompt) - _PROMPT_TAIL, 0)
    start = tokenizer.rfind_think_start(prompt, start=tail)
    return bool(start >= 0 and tokenizer.find_think_end(prompt, start=start) < 0)


@dataclass(frozen=True)
class ReasoningText:
    text: str


OutputEvent = ReasoningText | ParseEvent


@dataclass
class OutputPiece:
    """What the parser releases, in order, and the same summed up."""

    events: list[OutputEvent] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, event: OutputEvent) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(event, ReasoningText):
            if not event.text:
                return
            self.reasoning += event.text
            if isinstance(last, ReasoningText):
                self.events[-1] = ReasoningText(last.text + event.text)
                return
        elif isinstance(event, ContentText):
            if not event.text:
                return
            self.text += event.text
            if isinstance(last, ContentText):
                self.events[-1] = ContentText(last.text + event.text)
                return
        self.events.append(event)

    def extend(self, other: OutputPiece) -> None:
        for event in other.events:
            self.add(event)
        self.calls += other.calls


class TextParser(Protocol):
    """What the APIs read a choice's text through: `OutputParser`, or gpt-oss's
    `HarmonyParser` (server/harmony.py)."""

    calls: list[ToolCall]

    def feed(self, text: str) -> OutputPiece: ...
    def finish(self) -> OutputPiece: ...
    def reasoning_tokens(self, tokenizer: Any) -> int: ...


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class OutputParser:
    """One choice's text -> reasoning, content and tool calls, as it streams.

    `tools` parses the content for calls (None: no tools in play); `markers` None means
    the model does not think, and the text passes through unchanged.
    """

    def __init__(self, tools: ToolCallParser | None, markers: ThinkMarkers | None = None, *,
                 reasoning: bool = False) -> None:
        self._tools = tools
        self._markers = markers
        self._call_start = tools.syntax.start if tools is not None else None
        self._reasoning = reasoning and markers is not None
        self._buffer = ""
        self._trim = self._reasoning  # drop whitespace before the next run's first text
        self._thought: list[str] = []  # the reasoning released so far

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    @property
    def reasoning(self) -> str:
        """All the reasoning released so far."""
        return "".join(self._thought)

    def reasoning_tokens(self, tokenizer: Any) -> int:
        """How many tokens the reasoning took (its text encoded again: the markers and the
        whitespace around them are left out)."""
        text = self.reasoning
        return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def feed(self, text: str) -> OutputPiece:
        if self._markers is None:
            return self._content(text, final=False)
        self._buffer += text
        return self._noted(self._drain(final=False))

    def finish(self) -> OutputPiece:
        if self._markers is None:
            return self._content("", final=True)
        return self._noted(self._drain(final=True))

    def _noted(self, piece: OutputPiece) -> OutputPiece:
        if piece.reasoning:
            self._thought.append(piece.reasoning)
        return piece

    def _content(self, text: str, *, final: bool) -> OutputPiece:
        piece = OutputPiece()
        if self._tools is None:
            piece.add(ContentText(text))
            return piece
        parsed = self._tools.feed(text)
        if final:
            parsed.extend(self._tools.finish())
        for event in parsed.events:
            piece.add(event)
        piece.calls += parsed.calls
        return piece

    def _drain(self, *, final: bool) -> OutputPiece:
        assert self._markers is not None
        piece = OutputPiece()
        while True:
            if self._trim:
                self._buffer = self._buffer.lstrip()
                if not self._buffer and not final:
                    return piece
                self._trim = False
            ends = [self._markers.end] if self._reasoning else [self._markers.start]
            if self._reasoning and self._call_start:
                ends.append(self._call_start)
            found = [(at, m) for m in ends if (at := self._buffer.find(m)) >= 0]
            if not found:
                break
            at, marker = min(found)
            before, self._buffer = self._buffer[:at], self._buffer[at:]
            if marker != self._call_start:
                self._buffer = self._buffer[len(marker):]
            if self._reasoning:
                piece.add(ReasoningText(before.rstrip()))
            else:
                piece.extend(self._content(before, final=False))
            self._reasoning = not self._reasoning
            self._trim = True
        if final:
            rest, self._buffer = self._buffer, ""
            if self._reasoning:
                piece.add(ReasoningText(rest.rstrip()))
                piece.extend(self._content("", final=True))
            else:
                piece.extend(self._content(rest, final=True))
            return piece
        # Hold back what may begin a marker; in reasoning also trailing whitespace, which
        # is layout if the end marker follows.
        markers = [self._markers.end, self._call_start] if self._reasoning else [self._markers.start]
        keep = max(partial_suffix(self._buffer, m) for m in markers if m)
        ready = self._buffer[: len(self._buffer) - keep]
        if self._reasoning:
            ready = ready.rstrip()
            piece.add(ReasoningText(ready))
        else:
            piece.extend(self._content(ready, final=False))
        self._buffer = self._buffer[len(ready):]
        return piece
