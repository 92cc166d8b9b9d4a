"""/v1/responses as coding agents use it: Codex-shaped requests (tests/server/codex_corpus/)
stream to `response.completed`; forced calls of a namespaced function and of a custom tool
come back as Codex reads them and work as history; reasoning items sent back reach the
template; a call of a tool not offered is text; an oversized max_tokens is clamped on all
three APIs."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS
from tests.conftest import MODEL, ServerProcess
from tests.server.scripted import EOS, THINK, ScriptedModel, build_marked_model, scripted_server, token_ids

CORPUS = sorted((Path(__file__).parent / "codex_corpus").glob("*.json"))
FIRST_TURN = json.loads((Path(__file__).parent / "codex_corpus" / "first_turn.json").read_text())
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
# The tiny model writes random text: a response format makes it finish (`completed`).
ENDS = {"format": {"type": "json_schema", "name": "done", "schema": SCHEMA, "strict": True}}


def stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = list(r.iter_lines())
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names == [e["type"] for e in events]
    return events


def check_sequence(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The documented order; every output item added and done; the final response."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed", kinds[-1]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    response = events[-1]["response"]
    assert added == sorted(done) == list(range(len(response["output"])))
    assert [done[i] for i in added] == response["output"]
    usage = response["usage"]
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert isinstance(usage[key], int)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    assert isinstance(usage["input_tokens_details"]["cached_tokens"], int)
    return response


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_codex_shaped_requests_stream_to_completed(server, path):
    body = {**json.loads(path.read_text()), "text": ENDS, "max_output_tokens": 60}
    response = check_sequence(stream(server.url, body))
    assert response["status"] == "completed" and response["output"][0]["type"] == "message"
    json.loads(response["output"][0]["content"][0]["text"])
    # What was skipped is logged by name, never the prompt's text.
    lines = [line for line in server.log().splitlines() if "/v1/responses: ignored" in line]
    assert any("tool:web_search" in line and "field:prompt_cache_key" in line for line in lines), lines
    assert not any(body["instructions"][:30] in line for line in lines)


def test_a_forced_namespaced_call_carries_its_namespace_and_works_as_history(server):
    body = {**copy.deepcopy(FIRST_TURN), "tool_choice": {"type": "function", "name": "search_docs"},
            "max_output_tokens": 300}
    events = stream(server.url, body)
    response = check_sequence(events)
    call = response["output"][0]
    assert call["type"] == "function_call"
    assert (call["name"], call["namespace"]) == ("search_docs", "mcp__docs__")
    assert set(json.loads(call["arguments"])) == {"query"}
    assert "response.function_call_arguments.done" in [e["type"] for e in events]

    follow = {**copy.deepcopy(FIRST_TURN), "text": ENDS, "max_output_tokens": 60}
    follow["input"] += [{k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
                        {"type": "function_call_output", "call_id": call["call_id"], "output": "found"}]
    again = check_sequence(stream(server.url, follow))
    assert again["usage"]["input_tokens"] > response["usage"]["input_tokens"]


def test_a_forced_custom_tool_call_is_a_custom_tool_call_and_works_as_history(server):
    """A regex-grammar custom tool: the forced call keeps to the grammar, so it ends."""
    mode = {"type": "custom", "name": "set_mode", "description": "Pick a mode.",
            "format": {"type": "grammar", "syntax": "regex", "definition": "(fast|slow)"}}
    body = {**copy.deepcopy(FIRST_TURN), "tool_choice": {"type": "custom", "name": "set_mode"},
            "max_output_tokens": 300}
    body["tools"].append(mode)
    events = stream(server.url, body)
    response = check_sequence(events)
    call = response["output"][0]
    assert call["type"] == "custom_tool_call" and call["name"] == "set_mode"
    assert call["input"] in ("fast", "slow") and "namespace" not in call
    done = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert [e["input"] for e in done] == [call["input"]]

    follow = {**copy.deepcopy(FIRST_TURN), "text": ENDS, "max_output_tokens": 60}
    follow["tools"].append(mode)
    follow["input"] += [{k: call[k] for k in ("type", "call_id", "name", "input")},
                        {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "ok"}]
    check_sequence(stream(server.url, follow))


def test_a_custom_tool_inside_a_namespace_whole(server):
    body = {**copy.deepcopy(FIRST_TURN), "stream": False, "max_output_tokens": 300,
            "tool_choice": {"type": "custom", "name": "render"}}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    call = r.json()["output"][0]
    assert (call["type"], call["name"], call["namespace"]) == ("custom_tool_call", "render", "mcp__docs__")


def test_an_image_only_turn_is_refused_in_the_responses_error_shape(server):
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("image_input_unsupported", "input")
    assert "image" in error["message"]


def _clamped(r: httpx.Response, usage: dict | None = None) -> int:
    """The max_tokens the server used, from `x-max-tokens-clamped`: the context's room; the
    usage names it too."""
    used = int(r.headers["x-max-tokens-clamped"])
    assert 7000 < used < 8192
    if usage is not None:
        assert usage["max_tokens_clamped"] == used, usage
    return used


def test_an_oversized_max_tokens_is_clamped_on_all_three_apis(server):
    """32,000 on the 8,192-token tiny model, as Claude Code asks: served, not refused, and
    the header says what was used. Forced formats or calls end each output early."""
    ask = [{"role": "user", "content": "Hi"}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": ask, "max_tokens": 32000,
        "response_format": {"type": "json_schema", "json_schema": {"name": "done", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    assert _clamped(r, r.json()["usage"]) == 8192 - r.json()["usage"]["prompt_tokens"]
    r = httpx.post(server.url + "/v1/responses", timeout=120, json={
        "model": MODEL, "input": "Hi", "max_output_tokens": 32000, "text": ENDS})
    assert r.status_code == 200 and r.json()["status"] == "completed", r.text
    _clamped(r, r.json()["usage"])
    tool = {"name": "done", "input_schema": SCHEMA}
    body = {"model": MODEL, "messages": ask, "max_tokens": 32000, "tools": [tool],
            "tool_choice": {"type": "tool", "name": "done", "disable_parallel_tool_use": True}}
    r = httpx.post(server.url + "/v1/messages", timeout=120, json=body)
    assert r.status_code == 200, r.text
    _clamped(r, r.json()["usage"])
    with httpx.stream("POST", server.url + "/v1/messages", timeout=120, json={**body, "stream": True}) as s:
        assert s.status_code == 200
        _clamped(s)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": ask, "max_tokens": 2})
    assert "x-max-tokens-clamped" not in r.headers  # room enough: nothing to say
    assert "max_tokens_clamped" not in r.json()["usage"]


def test_only_a_prompt_that_does_not_fit_is_refused_with_its_size(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": [1] * 8200, "max_tokens": 1})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "8200" in error["message"] and "8192" in error["message"]


def test_the_openai_sdk_reads_namespaced_and_custom_calls(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    mode = {"type": "custom", "name": "set_mode",
            "format": {"type": "grammar", "syntax": "regex", "definition": "(fast|slow)"}}
    tools = [*copy.deepcopy(FIRST_TURN["tools"]), mode]
    for choice, kind in (({"type": "custom", "name": "set_mode"}, "custom_tool_call"),
                         ({"type": "function", "name": "search_docs"}, "function_call")):
        with client.responses.stream(model=MODEL, input="go", tools=tools, tool_choice=choice,
                                     parallel_tool_calls=False, max_output_tokens=300) as s:
            for _ in s:
                pass
            final = s.get_final_response()
        call = final.output[0]
        assert final.status == "completed" and call.type == kind
        if kind == "custom_tool_call":
            assert call.input in ("fast", "slow")
        else:
            assert (call.name, call.namespace) == ("search_docs", "mcp__docs__")


# The stream starts at once (no hold for admission, a heartbeat every millisecond), and the
# fifth decode step raises: the failure arrives after response.created.
FAILING_AFTER_START = """
import sys
import engine.core as core
import server.responses.routes as routes

routes.HOLD_S, routes.HEARTBEAT_S = 0.0, 0.001
decode = core.EngineCore._decode
steps = [0]

def failing_decode(self):
    if len(self.batch):
        steps[0] += 1
        if steps[0] >= 5:
            raise RuntimeError("injected engine bug")
    return decode(self)

core.EngineCore._decode = failing_decode
from server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_error_after_the_stream_started_is_response_failed(tiny_model_path, tmp_path):
    proc = ServerProcess(tiny_model_path, python_args=["-c", FAILING_AFTER_START]).start(tmp_path)
    try:
        with httpx.stream("POST", proc.url + "/v1/responses", timeout=60, json={
                "model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 50}) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        proc.stop()
    assert events[0]["type"] == "response.created"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    error = failed["response"]["error"]
    assert error["code"] == "server_error" and "injected engine bug" in error["message"]


def test_no_max_output_tokens_means_up_to_the_room_not_the_server_default(tiny_model_path):
    """Codex sends no max_output_tokens: a long answer must end `completed`, not cut at the
    server's default_max_tokens (an `incomplete` response fails Codex's turn)."""
    from tests.server.scripted import scripted_server

    eos = 256 + SPECIAL_TOKENS.index("<|im_end|>")
    with scripted_server(tiny_model_path, MODEL, eos, lambda t: list(t.encode()),
                         default_max_tokens=16) as (url, model):
        model.say("word " * 10)
        r = httpx.post(url + "/v1/responses", timeout=120, json={"model": MODEL, "input": "Hi"})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "completed" and r.json()["usage"]["output_tokens"] == 50
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]})
        assert r.json()["usage"]["completion_tokens"] == 16  # chat keeps the server's default


# The tiny model's template, rendering an assistant call turn's `reasoning_content` as
# Qwen3's does after the last user query.
CALL_TURN = "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
REASONING_TEMPLATE = CHAT_TEMPLATE.replace(CALL_TURN, (
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{%- endif %}"
    "{{- message['content'] or '' }}"))
EXEC = {"type": "function", "name": "exec_command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}


@pytest.fixture(scope="module")
def reasoner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ScriptedModel]]:
    assert CALL_TURN in CHAT_TEMPLATE
    path = build_marked_model(tmp_path_factory.mktemp("reasoner") / "model", THINK, REASONING_TEMPLATE)
    with scripted_server(path, "tiny-reasoner", EOS, token_ids) as served:
        yield served


def test_a_reasoning_item_sent_back_reaches_the_template(reasoner):
    """Codex sends the reasoning items it got back with the calls they led to: the text is
    the call turn's `reasoning_content`, which this template renders, token for token."""
    url, model = reasoner
    thought = "The user wants the files: run ls."
    history = [
        {"role": "user", "content": "list the files"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": thought}]},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
    ]

    def input_tokens(items: list[dict[str, Any]]) -> int:
        model.say("Done.")
        r = httpx.post(url + "/v1/responses", timeout=120,
                       json={"model": "tiny-reasoner", "input": items, "tools": [EXEC]})
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["text"] == "Done."
        return r.json()["usage"]["input_tokens"]

    without = input_tokens([item for item in history if item.get("type") != "reasoning"])
    assert input_tokens(history) - without == len(token_ids(f"<think>\n{thought}\n</think>\n\n"))


def test_a_call_of_a_hosted_tool_left_out_of_the_prompt_is_text(reasoner):
    """`web_search` is hosted, so not in the prompt; a model that calls it anyway gets its
    call back as text, not as a `function_call` the client has no function for."""
    url, model = reasoner
    model.say('<tool_call>\n{"name": "web_search", "arguments": {"query": "mlx"}}\n</tool_call>')
    response = check_sequence(stream(url, {"model": "tiny-reasoner", "input": "search for mlx",
                                           "tools": [EXEC, {"type": "web_search"}], "stream": True}))
    assert [item["type"] for item in response["output"]] == ["message"]
    text = response["output"][0]["content"][0]["text"]
    assert text == '{"name": "web_search", "arguments": {"query": "mlx"}}'
