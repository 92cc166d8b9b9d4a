"""Structured output and tool calling through a real server, with the official SDK.

The tiny model's weights are random: whatever it produces under a schema must still
parse and validate, which is the strongest test of the constraint.
"""

from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "mlx-headroom/tiny-chat"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "string", "enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                  "maximum": 14}},
                       "required": ["zone"], "additionalProperties": False},
    },
}
ARGS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    admin: bool


def test_parse_with_a_pydantic_model_returns_a_parsed_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=80, temperature=1.0, seed=1,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert message.refusal is None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_of_the_random_model_validates(client, seed):
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=seed, n=2,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema_rs.validate(PERSON, json.loads(choice.message.content))


def test_json_schema_streaming_validates(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=4, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema_rs.validate(PERSON, json.loads(text))


def test_json_object_output_is_an_object(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0, logit_bias={"125": 30},
        response_format={"type": "json_object"},
    )
    text = completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def test_unconstrained_requests_decode_beside_constrained_ones(client):
    """Different schemas and none at all, in one batch: each output keeps to its own."""
    import concurrent.futures

    def one(i: int):
        fmt = ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}} if i % 3 == 0 else
               {"type": "json_schema", "json_schema": {"name": "t", "schema": ARGS["get_time"]}}
               if i % 3 == 1 else None)
        kwargs = {"response_format": fmt} if fmt else {}
        return i, client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60,
                                                 temperature=1.0, seed=i, **kwargs)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    for i, completion in results:
        text = completion.choices[0].message.content
        if i % 3 == 0:
            jsonschema_rs.validate(PERSON, json.loads(text))
        elif i % 3 == 1:
            jsonschema_rs.validate(ARGS["get_time"], json.loads(text))
        else:
            assert completion.choices[0].finish_reason == "length"


def test_a_schema_that_cannot_compile_is_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}},
        )
    assert err.value.status_code == 400
    assert "strin" in err.value.message
    assert err.value.body["param"] == "response_format"


def test_one_forced_call_when_parallel_calls_are_off(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120,
        temperature=1.0, seed=8, parallel_tool_calls=False,
    )
    result = completion.choices[0]
    assert result.finish_reason == "tool_calls" and result.message.content is None
    assert len(result.message.tool_calls) == 1
    _check_calls(result.message.tool_calls, {"get_weather", "get_time"})


def _check_calls(calls, allowed: set[str]) -> None:
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed
        jsonschema_rs.validate(ARGS[call.function.name], json.loads(call.function.arguments))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid_calls(client, choice):
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200,
        temperature=1.0, seed=5,
    )
    result = completion.choices[0]
    # Parallel calls are allowed: the random model may keep calling until max_tokens.
    assert result.finish_reason in ("tool_calls", "length")
    assert result.message.content is None
    allowed = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    calls = result.message.tool_calls
    assert calls
    # a call cut off by max_tokens comes as generated (finish_reason says so), as OpenAI does
    _check_calls(calls if result.finish_reason == "tool_calls" else calls[:-1], allowed)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_stream_as_deltas(client, choice):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=120,
        temperature=1.0, seed=6, stream=True, parallel_tool_calls=False,
    )
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert entry["id"] is None, "id comes once, first"
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and content == ""
    assert len(calls) == 1
    allowed = {"get_weather", "get_time"} if choice == "required" else {"get_weather"}
    call = calls[0]
    assert call["id"] and call["name"] in allowed
    jsonschema_rs.validate(ARGS[call["name"]], json.loads(call["arguments"]))


def test_a_follow_up_turn_with_the_tool_result_works(client):
    first = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=120, seed=7,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                            max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_named_tool_that_is_not_among_the_tools_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "nope" in err.value.message
