"""The reasoning splitter on its own: streamed text in any split, thinking apart from the
answer, tool calls inside or after it still parsed, no marker leaked."""

from __future__ import annotations

import json

import pytest

from server.reasoning import OutputParser, ThinkMarkers, opens_in_reasoning
from server.tools import FunctionTool, ToolCallParser, ToolSyntax

THINK = ThinkMarkers("<think>", "</think>")
HERMES = ToolSyntax.for_tokenizer(object())
TOOLS = [FunctionTool("f", parameters={"type": "object"})]
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'

# (output, starts in reasoning, tools in play) -> (reasoning, content, calls' arguments)
CASES = [
    ("<think>\nplan it\n</think>\n\nThe answer.", False, False, "plan it", "The answer.", []),
    ("plan it\n</think>\n\nThe answer.", True, False, "plan it", "The answer.", []),
    ("The answer, no thinking.", False, False, "", "The answer, no thinking.", []),
    ("a < b, still thinking", True, False, "a < b, still thinking", "", []),  # cut off
    ("plan</think>\n" + CALL, True, True, "plan", "", [{"x": 1}]),  # a call after reasoning
    ("plan\n" + CALL, True, True, "plan", "", [{"x": 1}]),  # a call inside it, block unclosed
    ("<think>one</think>Let me call.\n" + CALL + "\n<think>two</think>Done.", False, True,
     "onetwo", "Let me call.\nDone.", [{"x": 1}]),
    ("x </thin", True, False, "x </thin", "", []),  # a partial marker at the end is text
]


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize(("output", "opens", "with_tools", "reasoning", "content", "calls"), CASES)
def test_any_split_gives_the_same_reasoning_content_and_calls(
        size, output, opens, with_tools, reasoning, content, calls):
    tools = ToolCallParser(HERMES, TOOLS) if with_tools else None
    parser = OutputParser(tools, THINK, reasoning=opens)
    got_reasoning, got_text, got_calls = "", "", []
    for i in range(0, len(output), size):
        piece = parser.feed(output[i:i + size])
        got_reasoning += piece.reasoning
        got_text += piece.text
        got_calls += piece.calls
    tail = parser.finish()
    got_reasoning += tail.reasoning
    got_text += tail.text
    got_calls += tail.calls
    assert (got_reasoning, got_text) == (reasoning, content)
    assert [json.loads(c.arguments) for c in got_calls] == calls
    if output != "x </thin":
        assert "<think>" not in got_text + got_reasoning
        assert "</think>" not in got_text + got_reasoning


def test_a_model_without_markers_passes_text_through():
    parser = OutputParser(None, None, reasoning=True)
    piece = parser.feed("<think>x</think>\n y")
    piece.extend(parser.finish())
    assert piece.text == "<think>x</think>\n y" and piece.reasoning == ""


def test_events_keep_the_order_reasoning_then_content():
    parser = OutputParser(None, THINK, reasoning=True)
    events = []
    for ch in "ab</think>cd":
        events += parser.feed(ch).events
    events += parser.finish().events
    kinds = [type(e).__name__ for e in events]
    assert kinds == sorted(kinds, key=lambda k: k != "ReasoningText")  # reasoning first
    assert len([k for k in kinds if k == "ReasoningText"]) >= 2  # streamed, not held to the end


class _Tokenizer:
    """mlx-lm's TokenizerWrapper's finders over a tiny vocabulary: 1 = <think>, 2 = </think>."""

    def rfind_think_start(self, tokens, start=None, end=None):
        idx = [i for i, t in enumerate(tokens) if t == 1 and i >= (start or 0)]
        return idx[-1] if idx else -1

    def find_think_end(self, tokens, start=None, end=None):
        return next((i for i, t in enumerate(tokens) if t == 2 and i >= (start or 0)), -1)


@pytest.mark.parametrize(("prompt", "opens"), [
    ([5, 6, 1, 7], True),  # the generation prompt opened the block
    ([5, 1, 9, 2, 7], False),  # an empty block: thinking switched off
    ([1, 9, 2, 5, 7], False),  # a closed block in an earlier turn
    ([5, 6, 7], False),
])
def test_a_prompt_that_ends_inside_a_thinking_block_starts_in_reasoning(prompt, opens):
    assert opens_in_reasoning(_Tokenizer(), prompt) is opens
