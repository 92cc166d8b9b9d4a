"""What a chat-shaped request (OpenAI chat, the Responses API) turns into before it is
submitted: prompt tokens through the chat template, the tools in play, the grammar that
forces a call or a response format, and each choice's output parser (reasoning apart, then
tool calls: server/reasoning.py; gpt-oss's Harmony channels: server/harmony.py).

Everything that can fail on bad input (the template, the tools, the schema) fails here,
as a 400, before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from engine.grammar import Grammar
from server.errors import BadRequest
from server.harmony import HarmonyParser, is_harmony
from server.reasoning import OutputParser, TextParser, ThinkMarkers, opens_in_reasoning
from server.state import ServerState
from server.structured import ProcessorFactory, Shaping, compile_grammar, grammar_compiler
from server.tools import (
    FunctionTool,
    ToolCallParser,
    ToolChoice,
    ToolError,
    ToolSyntax,
    check_tools,
    render_prompt,
    tool_call_grammar,
)


@dataclass(frozen=True)
class ChatPlan:
    tokens: list[int]
    tools: list[FunctionTool] = field(default_factory=list)
    syntax: ToolSyntax | None = None  # set when the output is parsed for tool calls
    new_processor: ProcessorFactory = lambda: None
    markers: ThinkMarkers | None = None  # the model's think markers, when it has them
    opens_reasoning: bool = False  # the prompt ends inside a thinking block
    harmony_tail: str | None = None  # gpt-oss: the prompt's last header, read as Harmony

    def parser(self) -> TextParser:
        """A fresh parser for one choice."""
        if self.harmony_tail is not None:
            return HarmonyParser(tools=bool(self.tools), prompt_tail=self.harmony_tail)
        tools = ToolCallParser(self.syntax, self.tools) if self.syntax is not None else None
        return OutputParser(tools, self.markers, reasoning=self.opens_reasoning)


async def plan_chat(
    state: ServerState,
    messages: list[dict[str, Any]],
    *,
    tools: list[FunctionTool],
    choice: ToolChoice,
    parallel_tool_calls: bool = True,
    response_format: Grammar | None = None,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    messages_param: str = "messages",
    tools_param: str = "tool_choice",
    format_param: str = "response_format",
) -> ChatPlan:
    chars = sum(len(m.get("content") or "") for m in messages)
    state.check_prompt_size(len(messages), chars)
    try:
        check_tools(tools, choice)
    except ToolError as exc:
        raise BadRequest(str(exc), code="invalid_tools", param=tools_param) from exc
    tokenizer = state.tokenizer
    active = tools if choice.mode != "none" else []

    def run() -> list[int]:
        if tokenizer.has_chat_template:
            return render_prompt(tokenizer, messages, active or None)
        text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages) + "\nassistant:"
        return list(tokenizer.encode(text))

    try:
        tokens = await asyncio.to_thread(run)
    except Exception as exc:
        raise BadRequest(f"the messages could not be formatted: {exc}", param=messages_param) from exc

    harmony = is_harmony(tokenizer)
    if harmony and active and choice.forces_call:
        raise BadRequest("forcing a tool call is not supported for gpt-oss's Harmony format; use "
                         "tool_choice 'auto'", code="invalid_tools", param=tools_param)
    syntax = ToolSyntax.for_tokenizer(tokenizer) if active else None
    grammar = response_format
    param = format_param
    if syntax is not None and choice.forces_call:
        try:
            grammar = tool_call_grammar(grammar_compiler(state), syntax, active, choice,
                                        parallel=parallel_tool_calls)
        except ToolError as exc:
            raise BadRequest(str(exc), code="invalid_tools", param=tools_param) from exc
        param = tools_param
    compiled = await compile_grammar(state, grammar, param=param) if grammar is not None else None
    shaping = Shaping(compiled, frequency_penalty, presence_penalty)
    markers = ThinkMarkers.for_tokenizer(tokenizer)
    # A grammar makes the output the document or the call from its first token: no thinking,
    # even where the template opened the block.
    opens = markers is not None and compiled is None and opens_in_reasoning(tokenizer, tokens)
    # A grammar makes the output the document from its first token, without a header.
    tail = tokenizer.decode(tokens[-16:]) if harmony and compiled is None else None
    return ChatPlan(tokens, active, syntax, shaping.factory(), markers, opens, tail)
