"""The Responses request's tools and input items on their own, without a server: flat
names and their map back, history as chat messages (reasoning folded into the assistant
turn it led to), calls of tools not offered as text, and the error codes agents read."""

from __future__ import annotations

import json

import pytest

from server.errors import APIError, BadRequest, InsufficientStorage, TooManyRequests
from server.reasoning import OutputParser, ThinkMarkers
from server.responses.builder import ResponseBuilder
from server.responses.items import ImageOnlyInput, to_conversation
from server.responses.schemas import ResponsesRequest
from server.responses.toolset import ToolRef, Toolset, custom_input
from server.tools import ToolCallParser, ToolSyntax

TOOLS = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
    {"type": "namespace", "name": "mcp__docs__", "description": "docs", "tools": [
        {"type": "function", "name": "search"},
        {"type": "custom", "name": "render", "format": {"type": "grammar", "syntax": "regex",
                                                        "definition": "[a-z]+"}}]},
    {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]},
    {"type": "custom", "name": "apply_patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "function", "name": "mcp__docs__search"},  # collides with the flattened name
    {"type": "web_search"}, {"type": "image_generation"}, {"type": "local_shell"},
    {"type": "something_new", "name": "x"},
]


def test_tools_flatten_to_unique_names_and_map_back():
    tools = Toolset.build(TOOLS)
    assert [f.name for f in tools.functions] == [
        "exec_command", "mcp__docs__search", "mcp__docs__render", "agents__spawn", "apply_patch",
        "mcp__docs__search_2"]
    assert tools.ref("mcp__docs__render") == ToolRef("custom", "render", "mcp__docs__")
    assert tools.ref("agents__spawn") == ToolRef("function", "spawn", "agents")
    assert tools.ref("mcp__docs__search_2") == ToolRef("function", "mcp__docs__search")
    assert tools.ref("made_up") is None and tools.ref("web_search") is None
    assert tools.ignored == ["web_search", "image_generation", "local_shell", "something_new"]


def test_a_custom_tool_is_a_function_of_one_string():
    tools = Toolset.build(TOOLS)
    by_name = {f.name: f for f in tools.functions}
    patch, render = by_name["apply_patch"], by_name["mcp__docs__render"]
    assert patch.parameters["required"] == ["input"] and "start: /.+/" in patch.description
    assert "pattern" not in patch.parameters["properties"]["input"]
    assert render.parameters["properties"]["input"]["pattern"] == "^(?:[a-z]+)$"
    assert custom_input('{"input": "*** Begin Patch"}') == "*** Begin Patch"
    assert custom_input('{"input": "cut of') == "cut of"


@pytest.mark.parametrize(("raw", "mode", "name"), [
    ("auto", "auto", None), ("required", "required", None), ("none", "none", None),
    ({"type": "function", "name": "search"}, "named", "mcp__docs__search"),
    ({"type": "function", "name": "search", "namespace": "mcp__docs__"}, "named", "mcp__docs__search"),
    ({"type": "custom", "name": "apply_patch"}, "named", "apply_patch"),
    ({"type": "allowed_tools", "mode": "required", "tools": []}, "required", None),
    ({"type": "web_search"}, "auto", None),
])
def test_tool_choice(raw, mode, name):
    choice = Toolset.build(TOOLS).choice(raw)
    assert (choice.mode, choice.name) == (mode, name)


def test_history_items_become_chat_messages():
    tools = Toolset.build(TOOLS)
    conv = to_conversation([
        {"type": "message", "role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "fix it"},
                                     {"type": "input_image", "image_url": "data:,"}]},
        {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "search", "namespace": "mcp__docs__",
         "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "hit"}]},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"},
        {"type": "web_search_call", "action": {"type": "search", "query": "q"}},
        {"type": "additional_tools", "tools": [{"type": "function", "name": "late"}]},
        {"type": "message", "role": "developer", "content": "mid"},
        {"type": "message", "role": "user", "content": "go on"},
    ], tools)
    assert conv.system == ["rules"]
    assert conv.messages == [
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "mcp__docs__search", "arguments": "{}"}},
            {"id": "c2", "type": "function",
             "function": {"name": "apply_patch", "arguments": json.dumps({"input": "*** Begin"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "hit"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "user", "content": "mid\n\ngo on"},
    ]
    assert conv.ignored == ["reasoning", "web_search_call"] and conv.images_dropped == 1
    assert tools.ref("late") == ToolRef("function", "late")


def _reasoning(text: str) -> dict:
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def test_reasoning_items_join_the_assistant_turn_they_led_to():
    """Codex sends back the reasoning items this server emitted: their text reaches the
    template as the next assistant turn's reasoning, which the template renders or drops."""
    call = {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"}
    conv = to_conversation([
        {"role": "user", "content": "fix it"},
        _reasoning("Look first."),
        call,
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Seen."},
                                          {"type": "summary_text", "text": "Done."}]},
        {"type": "reasoning", "summary": [], "encrypted_content": "another server's"},
        {"type": "message", "role": "assistant", "content": "Fixed."},
        {"role": "user", "content": "thanks"},
        _reasoning("Interrupted."),  # no assistant turn before the next user turn
        {"role": "user", "content": "hello?"},
    ], Toolset.build(TOOLS))
    call_message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "exec_command", "arguments": "{}"}}]}
    assert conv.messages == [
        {"role": "user", "content": "fix it"},
        {**call_message, "reasoning_content": "Look first.", "thinking": "Look first."},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "Fixed.", "reasoning_content": "Seen.\n\nDone.",
         "thinking": "Seen.\n\nDone."},
        {"role": "user", "content": "thanks\n\nhello?"},
    ]
    assert conv.ignored == ["reasoning", "reasoning"]  # the encrypted one, the interrupted one


def test_reasoning_before_a_message_and_its_call_is_not_gpt_oss_thinking():
    """gpt-oss's template refuses a call message with both content and thinking."""
    conv = to_conversation([
        {"role": "user", "content": "fix it"}, _reasoning("Plan."),
        {"type": "message", "role": "assistant", "content": "Looking."},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"},
    ], Toolset.build(TOOLS))
    assistant = conv.messages[1]
    assert assistant["reasoning_content"] == "Plan." and "thinking" not in assistant
    assert assistant["content"] == "Looking." and len(assistant["tool_calls"]) == 1


def test_a_stored_response_keeps_its_reasoning_for_previous_response_id():
    parser = OutputParser(None, ThinkMarkers("<think>", "</think>"), reasoning=True)
    builder = ResponseBuilder(ResponsesRequest(model="m", input="hi"), "m", parser)
    builder.feed("Think.</think>Answer.", final=True)
    assert builder.conversation() == [
        {"role": "assistant", "content": "Answer.", "reasoning_content": "Think.", "thinking": "Think."}]


HERMES = ToolSyntax.for_tokenizer(object())
UNOFFERED = ('Searching.\n<tool_call>\n{"name": "web_search", "arguments": {"query": "mlx"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>')


def test_a_call_of_a_tool_not_offered_is_text():
    """`web_search` is a hosted tool, left out of the prompt: a call of it (or of any name
    not offered) is text, streamed as such, and the offered call beside it a call."""
    toolset = Toolset.build(TOOLS)
    parser = OutputParser(ToolCallParser(HERMES, toolset.functions))
    builder = ResponseBuilder(ResponsesRequest(model="m", input="hi"), "m", parser, toolset)
    events = builder.start()
    for at in range(0, len(UNOFFERED), 7):  # in pieces, as the tokens arrive
        events += builder.feed(UNOFFERED[at:at + 7])
    events += builder.feed("", final=True)
    events += builder.finish("tool_calls", {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": 0}})
    message, call = builder.output
    text = message["content"][0]["text"]
    assert text == 'Searching.\n{"name": "web_search", "arguments": {"query": "mlx"}}'
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "exec_command",
                                                                           {"cmd": "ls"})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == text
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [0, 1] and "web_search" not in {e.get("name") for e in events}


def test_only_an_image_as_the_last_turn_is_refused():
    image = {"type": "input_image", "image_url": "data:,"}
    with pytest.raises(ImageOnlyInput):
        to_conversation([{"role": "user", "content": [image]}], Toolset())
    answered = [{"role": "user", "content": [image]}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and?"}]
    assert to_conversation(answered, Toolset()).images_dropped == 1


@pytest.mark.parametrize(("error", "code", "retry"), [
    (InsufficientStorage("no memory", code="insufficient_memory", headers={"Retry-After": "3"}),
     "rate_limit_exceeded", "try again in 3s"),
    (TooManyRequests("queue full", code="queue_full", headers={"Retry-After": "1"}),
     "rate_limit_exceeded", "try again in 1s"),
    (BadRequest("too long", code="context_length_exceeded"), "context_length_exceeded", None),
    (APIError("step failed", code="engine_step_failed"), "server_error", None),
])
def test_a_failed_stream_names_the_code_agents_read(error, code, retry):
    builder = ResponseBuilder(ResponsesRequest(model="m", input="hi"), "m", None)
    (event,) = builder.fail(error)
    assert event["type"] == "response.failed" and event["response"]["status"] == "failed"
    assert event["response"]["error"]["code"] == code
    if retry is not None:
        assert retry in event["response"]["error"]["message"]
