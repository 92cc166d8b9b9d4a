"""Anthropic tool use through the official SDK: forced calls valid against their schemas
even from the random tiny model, streamed input, and tool_result turns that continue."""

from __future__ import annotations

import json

import anthropic
import jsonschema_rs
import pytest

from tests.conftest import MODEL, ServerProcess

GREEDY = {"temperature": 0}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "The forecast for a city.", "input_schema": WEATHER},
    {"name": "get_time", "description": "The time in a zone.", "input_schema": TIME},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What's the weather in Paris for three days?"}]
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}


@pytest.fixture(scope="module")
def client(tiny_model_path, tmp_path_factory):
    proc = ServerProcess(tiny_model_path).start(tmp_path_factory.mktemp("anthropic-tools"))
    with anthropic.Anthropic(base_url=proc.url, api_key="unused", max_retries=0) as c:
        yield c
    proc.stop()


def tool_uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


def assert_valid_calls(message) -> list:
    """Every complete call's input is valid; with max_tokens, the last may be cut off."""
    calls = tool_uses(message)
    assert calls
    complete = calls[:-1] if message.stop_reason == "max_tokens" else calls
    assert complete
    for call in calls:
        assert call.id.startswith("toolu_")
    for call in complete:
        jsonschema_rs.validate(SCHEMAS[call.name], call.input)
    assert len({c.id for c in calls}) == len(calls)
    return calls


def test_any_forces_one_valid_call(client):
    m = client.messages.create(model=MODEL, max_tokens=120, tools=TOOLS, tool_choice=ONE_CALL,
                               messages=ASK, extra_body=GREEDY)
    calls = assert_valid_calls(m)
    assert len(calls) == 1 and m.content == calls  # nothing but the call
    assert m.stop_reason == "tool_use"


def test_named_tool_is_the_one_called(client):
    m = client.messages.create(model=MODEL, max_tokens=120, tools=TOOLS, messages=ASK,
                               tool_choice={"type": "tool", "name": "get_time",
                                            "disable_parallel_tool_use": True})
    [call] = assert_valid_calls(m)
    assert call.name == "get_time" and call.input["zone"] in {"UTC", "CET", "PST"}
    assert m.stop_reason == "tool_use"


def test_parallel_calls_are_each_valid_with_unique_ids(client):
    m = client.messages.create(model=MODEL, max_tokens=150, tools=TOOLS, messages=ASK,
                               tool_choice={"type": "any"})
    assert_valid_calls(m)
    ids = {c.id for c in tool_uses(m)}
    again = client.messages.create(model=MODEL, max_tokens=150, tools=TOOLS, messages=ASK,
                                   tool_choice={"type": "any"})
    assert ids.isdisjoint({c.id for c in tool_uses(again)})


def test_streamed_input_arrives_as_partial_json_and_equals_create(client):
    request = {"model": MODEL, "max_tokens": 120, "tools": TOOLS, "tool_choice": ONE_CALL,
               "messages": ASK, "extra_body": GREEDY}
    with client.messages.create(stream=True, **request) as raw:
        events = list(raw)
    fragments = [e.delta.partial_json for e in events
                 if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(fragments) > 3  # streamed while generated, not in one piece at the end
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[1].content_block
    assert start.type == "tool_use" and start.input == {} and start.id.startswith("toolu_")
    streamed_input = json.loads("".join(fragments))
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    whole = client.messages.create(**request)
    assert [(b.name, b.input) for b in tool_uses(final)] == [(b.name, b.input) for b in tool_uses(whole)]
    assert tool_uses(whole)[0].input == streamed_input
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_tool_result_turn_continues_the_conversation(client):
    first = client.messages.create(model=MODEL, max_tokens=120, tools=TOOLS, tool_choice=ONE_CALL,
                                   messages=ASK, extra_body=GREEDY)
    [call] = tool_uses(first)
    result = "Sunny, 24 C, all three days."
    history = [*ASK, {"role": "assistant", "content": [b.to_dict() for b in first.content]}]
    for is_error in (False, True):
        turn = {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "is_error": is_error,
             "content": [{"type": "text", "text": result}]}]}
        m = client.messages.create(model=MODEL, max_tokens=8, tools=TOOLS, messages=[*history, turn])
        assert m.stop_reason in {"max_tokens", "end_turn", "tool_use"}
        counted = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=[*history, turn])
        empty = {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": ""}]}
        without = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=[*history, empty])
        # the result's text reaches the prompt (byte-level tokens), marked when it is an error
        marker = len("Error: ") if is_error else 0
        assert counted.input_tokens - without.input_tokens == len(result) + marker
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted.input_tokens


def test_tool_choice_none_leaves_the_tools_out(client):
    with_tools = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=ASK,
                                              tool_choice={"type": "none"})
    bare = client.messages.count_tokens(model=MODEL, messages=ASK)
    auto = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=ASK)
    assert with_tools.input_tokens == bare.input_tokens < auto.input_tokens
    m = client.messages.create(model=MODEL, max_tokens=6, tools=TOOLS, messages=ASK,
                               tool_choice={"type": "none"})
    assert [b.type for b in m.content] == ["text"] and m.stop_reason == "max_tokens"


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "nope"}, {"type": "any"}])
def test_a_choice_that_cannot_be_served_is_a_400(client, choice):
    tools = TOOLS if choice["type"] == "tool" else []
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, max_tokens=5, tools=tools, tool_choice=choice, messages=ASK)
    assert exc.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
