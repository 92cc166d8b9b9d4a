"""Reasoning apart from the answer on all three APIs, streamed and whole, through a real
server.

The models are the tiny model with think markers, and with gpt-oss's Harmony markers and
layout, scripted (tests/server/scripted.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.scripted import (
    EOS,
    HARMONY,
    HARMONY_EOS,
    ScriptedModel,
    build_harmony_model,
    build_thinking_model,
    scripted_server,
    token_ids,
)

MODEL = "tiny-thinker"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ScriptedModel]]:
    path = build_thinking_model(tmp_path_factory.mktemp("thinker") / "model")
    with scripted_server(path, MODEL, EOS, token_ids) as (url, model):
        yield url, model


_asked = iter(range(10**6))


def _user() -> str:
    """A fresh question each time: a prompt the prefix cache has not seen is prefilled."""
    return f"question {next(_asked)}: what is the weather?"


def _sse(response: httpx.Response) -> list[tuple[str | None, Any]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            events.append((name, json.loads(line[6:])))
    return events


# -- chat completions -------------------------------------------------------------------

def test_chat_reasoning_content_whole(thinker):
    url, model = thinker
    model.say("The user asks about weather.\n</think>\n\nIt is sunny.")
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": _user()}], "max_tokens": 200})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The user asks about weather."
    assert message["content"] == "It is sunny."
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    # one token per byte: the reasoning's own text, without the markers and their whitespace
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 28}


def test_chat_reasoning_content_streamed(thinker):
    url, model = thinker
    model.say("Think a while.\n</think>\n\nIt is sunny.")
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": _user()}], "max_tokens": 200,
            "stream": True}) as r:
        assert r.status_code == 200
        deltas = [e["choices"][0]["delta"] for _, e in _sse(r) if e.get("choices")]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == ("Think a while.", "It is sunny.")
    assert sum(1 for d in deltas if d.get("reasoning_content")) > 1  # streamed as it comes


def test_chat_tool_call_after_reasoning(thinker):
    url, model = thinker
    model.say("I need the weather tool.\n</think>\n\n" + CALL)
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": _user()}], "max_tokens": 300,
        "tools": [TOOL]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "I need the weather tool."
    assert choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"


def test_a_response_format_is_the_answer_not_reasoning(thinker):
    """The template opened the block, but a grammar makes the output the document."""
    url, model = thinker
    model.say('{"ok":true}')
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": _user()}], "max_tokens": 50,
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert json.loads(message["content"]) == {"ok": True} and "reasoning_content" not in message


# -- Responses --------------------------------------------------------------------------

def test_responses_reasoning_item_whole(thinker):
    url, model = thinker
    model.say("Weather, so call the tool.\n" + CALL)  # the call inside the open block
    r = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "model": MODEL, "input": _user(), "max_output_tokens": 300,
        "tools": [{"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}]})
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "function_call"]
    assert output[0]["summary"] == []
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Weather, so call the tool."}]
    assert json.loads(output[1]["arguments"]) == {"city": "Paris"}
    assert r.json()["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_responses_reasoning_streamed_through_the_sdk(thinker):
    from openai import OpenAI

    url, model = thinker
    model.say("Think first.\n</think>\n\nIt is sunny.")
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    with client.responses.stream(model=MODEL, input=_user(), max_output_tokens=200) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Think first."
    assert final.output_text == "It is sunny."
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert kinds.count("response.reasoning_text.delta") > 1


# -- Anthropic --------------------------------------------------------------------------

def _messages(thinking: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 200,
                            "messages": [{"role": "user", "content": _user()}], **extra}
    if thinking is not None:
        body["thinking"] = thinking
    return body


def test_anthropic_thinking_block_when_enabled(thinker):
    url, model = thinker
    model.say("Let me think.\n</think>\n\nIt is sunny.")
    r = httpx.post(f"{url}/v1/messages", timeout=60,
                   json=_messages({"type": "enabled", "budget_tokens": 1024}))
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""},
        {"type": "text", "text": "It is sunny."},
    ]


def test_anthropic_thinking_dropped_when_not_enabled(thinker):
    url, model = thinker
    model.say("Let me think.\n</think>\n\nIt is sunny.")
    r = httpx.post(f"{url}/v1/messages", timeout=60, json=_messages(None))
    assert r.json()["content"] == [{"type": "text", "text": "It is sunny."}]


def test_anthropic_thinking_streamed_through_the_sdk_with_a_tool_call(thinker):
    import anthropic

    url, model = thinker
    model.say("Use the tool.\n</think>\n\n" + CALL)
    client = anthropic.Anthropic(base_url=url, api_key="none")
    tool = {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}
    with client.messages.stream(**_messages({"type": "enabled", "budget_tokens": 1024},
                                            tools=[tool])) as stream:
        kinds = [getattr(event, "type", "") for event in stream]
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "Use the tool."
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    assert "thinking" in kinds or "content_block_delta" in kinds


# -- gpt-oss's Harmony channels ---------------------------------------------------------

H_THINK = "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
H_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
          '<|message|>{"city": "Paris"}')
H_FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ScriptedModel]]:
    path = build_harmony_model(tmp_path_factory.mktemp("harmony") / "model")
    with scripted_server(path, MODEL, HARMONY_EOS[0], lambda t: token_ids(t, HARMONY)) as served:
        yield served


def test_harmony_analysis_is_reasoning_and_commentary_a_call_on_chat(harmony):
    url, model = harmony
    model.say(H_THINK + H_CALL)
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": _user()}], "max_tokens": 300,
        "tools": [TOOL]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "Need the weather tool."
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}


def test_harmony_final_is_the_answer_streamed_on_chat_and_responses(harmony):
    url, model = harmony
    model.say(H_THINK + H_FINAL)
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": _user()}], "max_tokens": 300,
            "stream": True}) as r:
        deltas = [e["choices"][0]["delta"] for _, e in _sse(r) if e.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Need the weather tool."
    assert "".join(d.get("content") or "" for d in deltas) == "It is sunny."
    r = httpx.post(f"{url}/v1/responses", timeout=60,
                   json={"model": MODEL, "input": _user(), "max_output_tokens": 300})
    output = r.json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"][0]["text"] == "Need the weather tool."
    assert output[1]["content"][0]["text"] == "It is sunny."


def test_harmony_on_anthropic_thinking_and_tool_use(harmony):
    url, model = harmony
    model.say(H_THINK + H_CALL)
    tool = {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}
    r = httpx.post(f"{url}/v1/messages", timeout=60, json=_messages(
        {"type": "enabled", "budget_tokens": 1024}, tools=[tool]))
    assert r.status_code == 200, r.text
    content = r.json()["content"]
    assert [b["type"] for b in content] == ["thinking", "tool_use"]
    assert content[0]["thinking"] == "Need the weather tool."
    assert content[1]["input"] == {"city": "Paris"} and r.json()["stop_reason"] == "tool_use"


def test_harmony_refuses_a_forced_call_clearly(harmony):
    url, _ = harmony
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": _user()}], "tools": [TOOL],
        "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_tools"
    assert "Harmony" in r.json()["error"]["message"]
