"""Tool calling, independent of any one API's shapes (OpenAI chat, Responses, Anthropic).

Three jobs, each one function or class:
- prompt side: `render_prompt` puts the tools and a history with calls and results
  through the model's own chat template (`apply_chat_template(..., tools=...)`);
- constraint side: `tool_call_grammar` turns "must call a tool" (OpenAI's `required` or
  a named function, Anthropic's `any` or `tool`) into a grammar, so the output IS a
  call whose arguments are valid against the tool's JSON schema;
- parsing side: `ToolCallParser` splits generated text into plain text and calls, as it
  streams, with mlx-lm's parser for the model family (Hermes/Qwen `<tool_call>` JSON,
  Mistral, Llama-style JSON, ...). Markup never leaks into the text.

Families mlx-lm does not recognise fall back to Hermes-style `<tool_call>` JSON blocks,
which is also what the forced-call grammar produces for them.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.grammar import Grammar, GrammarCompiler, lark_json, lark_literal

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False

    def template_entry(self) -> dict[str, Any]:
        """The OpenAI shape that Hugging Face chat templates expect in `tools`."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")


class ToolError(ValueError):
    """Tools or tool_choice that cannot be served; the message names the problem."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class ToolSyntax:
    """How one model family writes a call: markers around it and the parser inside."""

    start: str
    end: str
    parse: Any  # (text, tools) -> {"name": ..., "arguments": ...}
    # The body is `{"name": ..., "arguments": ...}` JSON (Hermes, Qwen 2.5, mlx-lm's
    # `json_tools`): a grammar can force it and the arguments can be streamed.
    hermes_json: bool = False

    @staticmethod
    def for_tokenizer(tokenizer: Any) -> ToolSyntax:
        if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
            parse = tokenizer.tool_parser
            json_body = getattr(parse, "__module__", "").endswith(".json_tools")
            return ToolSyntax(tokenizer.tool_call_start, tokenizer.tool_call_end or "", parse,
                              hermes_json=json_body)
        return ToolSyntax(HERMES_START, HERMES_END, _parse_hermes, hermes_json=True)


def _parse_hermes(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


def check_tools(tools: list[FunctionTool], choice: ToolChoice) -> None:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("tool names must be unique")
    if choice.forces_call and not tools:
        raise ToolError(f"tool_choice '{choice.mode}' needs at least one tool")
    if choice.mode == "named" and choice.name not in names:
        raise ToolError(f"tool_choice names '{choice.name}', which is not among the tools")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped history -> what chat templates expect: call arguments as objects."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            converted = []
            for call in calls:
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    with contextlib.suppress(json.JSONDecodeError):
                        function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                converted.append({**call, "function": function})
            message = {**message, "tool_calls": converted}
        out.append(message)
    return out


def render_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[FunctionTool] | None
) -> list[int]:
    """Token ids of the conversation through the model's chat template. Blocking."""
    kwargs: dict[str, Any] = {"add_generation_prompt": True}
    if tools:
        kwargs["tools"] = [t.template_entry() for t in tools]
    return list(tokenizer.apply_chat_template(template_messages(messages), **kwargs))


def tool_call_grammar(
    compiler: GrammarCompiler,
    syntax: ToolSyntax,
    tools: list[FunctionTool],
    choice: ToolChoice,
    *,
    parallel: bool,
) -> Grammar | None:
    """A grammar whose every sentence is one call (or several when `parallel`) of the
    allowed tools, arguments valid against their schemas. None when nothing is forced."""
    if not choice.forces_call:
        return None
    if not syntax.hermes_json:
        raise ToolError(
            f"forcing a tool call is supported for Hermes-style <tool_call> JSON models; this "
            f"model writes calls as {syntax.start!r}...; use tool_choice 'auto'"
        )
    allowed = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    bodies = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                "arguments": t.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in allowed
    ]
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    start = compiler.special_token(syntax.start) or lark_literal(syntax.start + "\n")
    end = compiler.special_token(syntax.end) or lark_literal("\n" + syntax.end)
    repeat = '(call "\\n")* call' if parallel else "call"
    lark = f"start: {repeat}\ncall: {start} body {end}\nbody: {lark_json(body)}\n"
    return Grammar.lark(lark, what="tool-call grammar")


@dataclass(frozen=True)
class ContentText:
    text: str


@dataclass(frozen=True)
class CallStarted:
    """A call's id and name are known; its arguments follow as `ArgumentsDelta`s."""

    call_id: str
    name: str
    index: int  # the call's position among this output's calls


@dataclass(frozen=True)
class ArgumentsDelta:
    call_id: str
    index: int
    delta: str


@dataclass(frozen=True)
class CallDone:
    call: ToolCall
    index: int


ParseEvent = ContentText | CallStarted | ArgumentsDelta | CallDone


@dataclass
class ParsedPiece:
    """What the parser releases, in order (`events`), and the same summed up: the text and
    the calls completed in this piece."""

    events: list[ParseEvent] = field(default_factory=list)
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add_text(self, text: str) -> None:
        if not text:
            return
        self.text += text
        if self.events and isinstance(self.events[-1], ContentText):
            self.events[-1] = ContentText(self.events[-1].text + text)
        else:
            self.events.append(ContentText(text))

    def extend(self, other: ParsedPiece) -> None:
        for event in other.events:
            if isinstance(event, ContentText):
                self.add_text(event.text)
            else:
                self.events.append(event)
        self.calls += other.calls


# `{"name": "...", "arguments": ` at the start of a Hermes call body: from here on the
# arguments can be streamed as they are generated.
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_TAIL = re.compile(r"\s*\}?\s*$")  # what may close the call object after the arguments


@dataclass
class _OpenCall:
    id: str
    name: str
    index: int
    arguments: str = ""


class ToolCallParser:
    """Streaming split of generated text into content and tool calls.

    Text that could be the beginning of a call marker is held back until it is clearly
    not, so markup never reaches the client. For Hermes-style JSON calls the name is
    released as soon as it is complete and the arguments as they are generated (holding
    back only what may be the closing brace); other families' calls are released whole
    when their end marker arrives (or at the end of the output).
    """

    def __init__(self, syntax: ToolSyntax, tools: list[FunctionTool]) -> None:
        self.syntax = syntax
        self._tools = [t.template_entry() for t in tools]
        self._buffer = ""
        self._in_call = False
        self._open: _OpenCall | None = None
        self.calls: list[ToolCall] = []
        self._started = 0

    def feed(self, text: str) -> ParsedPiece:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> ParsedPiece:
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> ParsedPiece:
        piece = ParsedPiece()
        start, end = self.syntax.start, self.syntax.end
        while True:
            if not self._in_call:
                at = self._buffer.find(start)
                if at < 0:
                    if final:
                        rest = self._buffer
                        piece.add_text(rest.rstrip() if self._started else rest)
                        self._buffer = ""
                        return piece
                    # Hold back a possible marker start, and trailing whitespace: it may
                    # be the separator before a call, which is markup, not content.
                    cut = len(self._buffer) - _partial_suffix(self._buffer, start)
                    cut = len(self._buffer[:cut].rstrip())
                    piece.add_text(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return piece
                piece.add_text(self._buffer[:at].rstrip())  # the newline before a call is markup
                self._buffer = self._buffer[at + len(start):]
                self._in_call = True
            if self._open is None and self.syntax.hermes_json:
                head = _HERMES_HEAD.match(self._buffer)
                if head is not None:
                    self._open = _OpenCall("call_" + uuid.uuid4().hex[:24], json.loads(f'"{head.group(1)}"'),
                                           self._started)
                    self._started += 1
                    piece.events.append(CallStarted(self._open.id, self._open.name, self._open.index))
                    self._buffer = self._buffer[head.end():]
            at = self._buffer.find(end) if end else -1
            if at < 0:
                if final:
                    if self._open is not None:  # cut off by max_tokens: what there is
                        cut = len(self._buffer) - _partial_suffix(self._buffer, end)
                        self._close_open(self._buffer[:cut], piece)
                    else:
                        self._emit(self._buffer, piece, truncated=True)
                    self._buffer, self._in_call = "", False
                elif self._open is not None:
                    keep = _partial_suffix(self._buffer, end)
                    ready = self._buffer[: len(self._buffer) - keep]
                    ready = ready[: _TAIL.search(ready).start()]  # type: ignore[union-attr]
                    self._release(ready, piece)
                    self._buffer = self._buffer[len(ready):]
                return piece
            if self._open is not None:
                self._close_open(self._buffer[:at], piece)
            else:
                self._emit(self._buffer[:at], piece, truncated=False)
            self._buffer = self._buffer[at + len(end):]
            self._in_call = False

    def _release(self, text: str, piece: ParsedPiece) -> None:
        assert self._open is not None
        if text:
            self._open.arguments += text
            piece.events.append(ArgumentsDelta(self._open.id, self._open.index, text))

    def _close_open(self, rest: str, piece: ParsedPiece) -> None:
        assert self._open is not None
        self._release(rest[: _TAIL.search(rest).start()], piece)  # type: ignore[union-attr]
        call = ToolCall(self._open.name, self._open.arguments, self._open.id)
        self.calls.append(call)
        piece.calls.append(call)
        piece.events.append(CallDone(call, self._open.index))
        self._open = None

    def _emit(self, body: str, piece: ParsedPiece, *, truncated: bool) -> None:
        """A whole call body (families without streaming support, or an odd Hermes body)."""
        if not body.strip():
            return
        try:
            parsed = self.syntax.parse(body, self._tools)
        except Exception:
            parsed = None
        calls = parsed if isinstance(parsed, list) else [parsed]
        if parsed is None or not all(isinstance(c, dict) and c.get("name") for c in calls):
            # A call cut off by max_tokens is dropped (the finish reason says "length");
            # a complete block that is not a call is kept as text, without the markers.
            if not truncated:
                piece.add_text(body.strip())
            return
        for c in calls:
            arguments = c.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            call = ToolCall(str(c["name"]), arguments)
            index = self._started
            self._started += 1
            self.calls.append(call)
            piece.calls.append(call)
            piece.events += [CallStarted(call.id, call.name, index),
                             ArgumentsDelta(call.id, index, arguments), CallDone(call, index)]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
