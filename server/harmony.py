"""gpt-oss's Harmony output: channels split into reasoning, answer and tool calls.

gpt-oss writes every message with a header and a body, the markers being special tokens
of its vocabulary that mlx-lm does not interpret (its tokenizer reports no thinking and
no tool parser for them):

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

(the second message is one line). The generation prompt ends with `<|start|>assistant`,
so the output starts with a header; a template that writes the header itself (a prompt
ending in `<|message|>`) starts it in that header's body.

The channel decides what the body is: `analysis` the reasoning (`ReasoningText`),
`final` the answer (`ContentText`), `commentary` with a recipient (`to=functions.NAME`,
before or after the channel) a call of NAME whose arguments are the body, streamed as
they are generated; `commentary` without one is a preamble the user may see (content). A
body ends at `<|end|>`, `<|call|>` or `<|return|>` (the last two are EOS: the engine
drops them, so the end of the output ends the body too). Markers never reach the client;
a partial marker at the end of a piece is held back until it is clearly not one. Text
that never becomes a header (no marker in its first `PLAIN_AFTER` characters) is content.
"""

from __future__ import annotations

import contextlib
import re
import uuid
import weakref
from typing import Any

from server.reasoning import OutputPiece, ReasoningText, partial_suffix
from server.tools import ArgumentsDelta, CallDone, CallStarted, ContentText, ToolCall

MESSAGE = "<|message|>"
START = "<|start|>"
PLAIN_AFTER = 256
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_MARKER = re.compile(r"<\|[a-z_]+\|>")


_known: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def is_harmony(tokenizer: Any) -> bool:
    """Whether the vocabulary has Harmony's header markers (gpt-oss). Asked once per
    tokenizer (an unloaded model's is forgotten): building a large vocabulary's dict takes
    tens of milliseconds."""
    try:
        return _known[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        vocab = {}
    known = all(m in vocab for m in ("<|channel|>", MESSAGE, "<|end|>", START))
    with contextlib.suppress(TypeError):  # a tokenizer that takes no weak reference
        _known[tokenizer] = known
    return known


class HarmonyParser:
    """One choice's Harmony text -> reasoning, content and calls, as it streams. Calls are
    reported only when `tools` is true (tools in play); otherwise their bodies are dropped."""

    def __init__(self, *, tools: bool, prompt_tail: str = "") -> None:
        self._tools = tools
        self._buffer = ""
        self._in_header = True  # reading a header (kept whole in the buffer until <|message|>)
        self._kind = ""  # the open body's: "reasoning", "content", "call" or "drop"
        self._call: tuple[str, str, int] | None = None  # (id, name, index) of the open call
        self._arguments = ""
        self._started = 0
        self.calls: list[ToolCall] = []
        self._thought: list[str] = []
        if MESSAGE in prompt_tail.rpartition(START)[2]:  # the template opened a body
            self._buffer = prompt_tail.rpartition(START)[2]
            self._drain(final=False)
            self.calls, self._thought = [], []

    @property
    def reasoning(self) -> str:
        return "".join(self._thought)

    def reasoning_tokens(self, tokenizer: Any) -> int:
        text = self.reasoning
        return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def feed(self, text: str) -> OutputPiece:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> OutputPiece:
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> OutputPiece:
        piece = OutputPiece()
        while True:
            if self._in_header:
                at = self._buffer.find(MESSAGE)
                if at < 0 and len(self._buffer) > PLAIN_AFTER and "<|" not in self._buffer:
                    self._in_header, self._kind = False, "content"  # plain text, no header
                    continue
                if at < 0:
                    if final:  # a header that never finished says nothing
                        self._buffer = ""
                    break
                self._open(self._buffer[:at], piece)
                self._buffer = self._buffer[at + len(MESSAGE):]
                continue
            found = [(at, m) for m in ENDS if (at := self._buffer.find(m)) >= 0]
            if not found:
                if final:
                    self._body(self._buffer, piece)
                    self._buffer = ""
                    self._close(piece)
                    break
                keep = max(partial_suffix(self._buffer, m) for m in ENDS)
                self._body(self._buffer[: len(self._buffer) - keep], piece)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            at, marker = min(found)
            self._body(self._buffer[:at], piece)
            self._buffer = self._buffer[at + len(marker):]
            self._close(piece)
        if piece.reasoning:
            self._thought.append(piece.reasoning)
        return piece

    def _open(self, header: str, piece: OutputPiece) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._in_header = False
        if recipient is not None:
            if not self._tools:
                self._kind = "drop"
                return
            name = recipient.group(1).removeprefix("functions.")
            self._call = ("call_" + uuid.uuid4().hex[:24], name, self._started)
            self._started += 1
            self._arguments = ""
            self._kind = "call"
            piece.add(CallStarted(self._call[0], name, self._call[2]))
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _body(self, text: str, piece: OutputPiece) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            piece.add(ReasoningText(text))
        elif self._kind == "content":
            piece.add(ContentText(_MARKER.sub("", text)))
        elif self._kind == "call" and self._call is not None:
            self._arguments += text
            piece.add(ArgumentsDelta(self._call[0], self._call[2], text))

    def _close(self, piece: OutputPiece) -> None:
        if self._kind == "call" and self._call is not None:
            call = ToolCall(self._call[1], self._arguments.strip() or "{}", self._call[0])
            self.calls.append(call)
            piece.calls.append(call)
            piece.add(CallDone(call, self._call[2]))
            self._call = None
        self._in_header, self._kind = True, ""
