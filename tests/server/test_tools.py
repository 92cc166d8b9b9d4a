"""The tool-call parser on its own: streamed text in any split, calls out, no markup leaked."""

from __future__ import annotations

import json

import pytest

from server.tools import FunctionTool, ToolCallParser, ToolChoice, ToolError, ToolSyntax, check_tools

HERMES = ToolSyntax.for_tokenizer(object())  # no mlx-lm parser: Hermes JSON fallback
TOOLS = [FunctionTool("f", parameters={"type": "object"})]
OUTPUT = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n' \
         '{"name": "f", "arguments": {"x": 2}}\n</tool_call>'


@pytest.mark.parametrize("size", [1, 3, 7, len(OUTPUT)])
def test_any_split_gives_the_same_text_and_calls(size):
    parser = ToolCallParser(HERMES, TOOLS)
    text, calls = "", []
    for i in range(0, len(OUTPUT), size):
        piece = parser.feed(OUTPUT[i:i + size])
        assert "<" not in piece.text  # no partial marker is ever released
        text += piece.text
        calls += piece.calls
    tail = parser.finish()
    text, calls = text + tail.text, calls + tail.calls
    assert text == "Sure."
    assert [json.loads(c.arguments) for c in calls] == [{"x": 1}, {"x": 2}]
    assert len({c.id for c in calls}) == 2


def test_a_call_cut_off_by_max_tokens_is_dropped_and_plain_text_kept():
    parser = ToolCallParser(HERMES, TOOLS)
    piece = parser.feed('a < b <tool_call>\n{"name": "f", "argu')
    tail = parser.finish()
    assert piece.text + tail.text == "a < b" and not parser.calls


def test_named_choice_must_name_a_tool():
    with pytest.raises(ToolError, match="g"):
        check_tools(TOOLS, ToolChoice("named", "g"))
    with pytest.raises(ToolError):
        check_tools([], ToolChoice("required"))


def test_hermes_arguments_stream_as_they_are_generated():
    parser = ToolCallParser(HERMES, TOOLS)
    text = '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2, 3], "y": "}"}}\n</tool_call>'
    events = []
    for ch in text:
        events += parser.feed(ch).events
    events += parser.finish().events
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "CallStarted" and events[0].name == "f" and kinds[-1] == "CallDone"
    deltas = [e.delta for e in events if type(e).__name__ == "ArgumentsDelta"]
    assert len(deltas) > 5  # fragments, not one piece at the end
    assert "".join(deltas) == events[-1].call.arguments == '{"x": [1, 2, 3], "y": "}"}'
    assert json.loads(events[-1].call.arguments) == {"x": [1, 2, 3], "y": "}"}


def test_a_family_with_its_own_mlx_lm_parser_mistral():
    from mlx_lm.tool_parsers import mistral

    syntax = ToolSyntax(mistral.tool_call_start, mistral.tool_call_end, mistral.parse_tool_call)
    parser = ToolCallParser(syntax, TOOLS)
    output = 'Sure[TOOL_CALLS]f[ARGS]{"x": 1}'
    text = "".join(parser.feed(ch).text for ch in output)
    tail = parser.finish()
    assert text + tail.text == "Sure"
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("f", {"x": 1})]
    assert [type(e).__name__ for e in tail.events] == ["CallStarted", "ArgumentsDelta", "CallDone"]
