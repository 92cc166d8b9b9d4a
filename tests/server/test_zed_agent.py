"""Zed's agent against the server, as docs/agents.md configures it: an OpenAI-compatible
provider whose requests are Zed's own shape (its `open_ai` crate's `Request`: streamed, with
`stream_options.include_usage`, `max_completion_tokens`, tools and the history's tool calls),
read back the way Zed reads a stream: `data:` lines up to `[DONE]`, each an event with a
`choices` list and an optional `usage` holding the three token counts."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.conftest import MODEL

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file in the project",
    # an enum: the random model's forced call then ends within a few tokens
    "parameters": {"type": "object", "properties": {"path": {"enum": ["main.py", "README.md"]}},
                   "required": ["path"], "additionalProperties": False}}}


def zed_request(**extra: Any) -> dict[str, Any]:
    """A second turn: the model called read_file, and the tool's output came back."""
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a coding agent in Zed."},
            {"role": "user", "content": [{"type": "text", "text": "What does main.py print?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "read_file", "arguments": "{\"path\":\"main.py\"}"}}]},
            {"role": "tool", "content": "print('hi')", "tool_call_id": "call_1"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 24,
        "temperature": 1.0,
        "tools": [READ_FILE],
        **extra,
    }


def read_like_zed(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": "Bearer sk-local"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            data = line.removeprefix("data: ").removeprefix("data:")
            if data == line or not data:
                continue
            if data == "[DONE]":
                break
            event = json.loads(data)
            assert "error" not in event, event
            assert isinstance(event["choices"], list)  # required by Zed's ResponseStreamEvent
            for choice in event["choices"]:
                assert isinstance(choice["index"], int) and "finish_reason" in choice
            events.append(event)
    return events


def test_a_zed_turn_streams_text_and_usage_last(server) -> None:
    events = read_like_zed(server.url, zed_request(tool_choice="auto"))
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finish in (["length"], ["stop"], ["tool_calls"])
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == []
    assert {"prompt_tokens", "completion_tokens", "total_tokens"} <= set(usage)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


def test_a_tool_call_streams_as_zed_assembles_it(server) -> None:
    """Zed keys a call by `index`, takes `id` and `function.name` when they come and
    concatenates `function.arguments`."""
    events = read_like_zed(server.url, zed_request(tool_choice="required", parallel_tool_calls=False,
                                                   max_completion_tokens=200))
    calls: dict[int, dict[str, str]] = {}
    for e in events:
        for choice in e["choices"]:
            for chunk in (choice.get("delta") or {}).get("tool_calls") or []:
                call = calls.setdefault(chunk["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] = chunk.get("id") or call["id"]
                function = chunk.get("function") or {}
                call["name"] = function.get("name") or call["name"]
                call["arguments"] += function.get("arguments") or ""
    assert len(calls) == 1, events
    call = calls[0]
    assert call["id"] and call["name"] == "read_file"
    assert json.loads(call["arguments"]) in ({"path": "main.py"}, {"path": "README.md"})
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finish == ["tool_calls"]
