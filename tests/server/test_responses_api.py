"""POST /v1/responses through a real server, with the official SDK and raw SSE."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import openai
import pytest

MODEL = "mlx-headroom/tiny-chat"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False},
}
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "result", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_create_with_text(client):
    response = client.responses.create(model=MODEL, input="Hello", instructions="Be brief.",
                                       max_output_tokens=8, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message"
    assert response.output_text
    assert response.usage.output_tokens == 8 and response.usage.input_tokens > 0


def test_create_with_a_function_tool_and_the_follow_up(client):
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_output_tokens=100, temperature=1.0)
    assert response.status == "completed"
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema_rs.validate(WEATHER["parameters"], json.loads(calls[0].arguments))
    follow = client.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )
    assert follow.usage.input_tokens > response.usage.input_tokens


def test_create_with_text_format_json_schema(client):
    response = client.responses.create(model=MODEL, input="Give a result", text=JSON_FORMAT,
                                       max_output_tokens=60, temperature=1.0)
    assert response.status == "completed"
    jsonschema_rs.validate(SCHEMA, json.loads(response.output_text))


def test_stream_with_json_schema_gives_the_final_response(client):
    with client.responses.stream(model=MODEL, input="Give a result", text=JSON_FORMAT,
                                 max_output_tokens=60, temperature=1.0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == deltas
    jsonschema_rs.validate(SCHEMA, json.loads(deltas))


def test_stream_with_a_function_tool(client):
    with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 parallel_tool_calls=False, max_output_tokens=100) as stream:
        kinds = []
        for e in stream:
            if not kinds or kinds[-1] != e.type:
                kinds.append(e.type)  # argument deltas: one entry for the run of them
        final = stream.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema_rs.validate(WEATHER["parameters"], json.loads(call.arguments))
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]


def test_text_stream_events_come_in_the_documented_order(server):
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60, json={
            "model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 6, "temperature": 0}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-4]["text"] == text and events[-1]["response"]["output"][0]["content"][0]["text"] == text


def test_a_stream_echoing_an_integer_beyond_64_bits_is_served(server):
    # Found by the fuzz test: a tool schema's 2**70 bound, echoed in response.created, made
    # orjson raise mid-stream (a 500 after the 200).
    tool = {"type": "function", "name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 2**70}}}}
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60, json={
            "model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 4, "tools": [tool],
            "tool_choice": "none"}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0]["response"]["tools"][0]["parameters"]["properties"]["n"]["maximum"] == 2**70
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_previous_response_id_continues_a_stored_response_and_unknown_ids_are_refused(client):
    first = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0,
                                    store=True)
    assert client.responses.retrieve(first.id).id == first.id
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2)  # store defaults false
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input="y", previous_response_id=missing, max_output_tokens=2)
        assert err.value.body["param"] == "previous_response_id"


def test_a_refused_stream_is_a_real_507_before_any_event(small_machine):
    from tests.server.test_memory_guard import MiB, assert_507, set_ceiling_above_usage

    proc = small_machine
    set_ceiling_above_usage(proc.url, 2 * MiB)
    r = httpx.post(f"{proc.url}/v1/responses", timeout=60, json={
        "model": MODEL, "stream": True, "max_output_tokens": 10, "input": "y" * 3000})
    assert_507(r)
    assert not r.headers["content-type"].startswith("text/event-stream")


def test_an_empty_input_with_instructions_or_a_previous_response_is_served(client, server):
    first = client.responses.create(model=MODEL, input=[], instructions="Say hello.",
                                    max_output_tokens=3, store=True)
    assert first.status in ("completed", "incomplete") and first.usage.input_tokens > 0
    follow = client.responses.create(model=MODEL, input=[], previous_response_id=first.id,
                                     max_output_tokens=3)
    assert follow.usage.input_tokens > first.usage.input_tokens
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={"model": MODEL, "input": []})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "empty_input" and r.json()["error"]["param"] == "input"
