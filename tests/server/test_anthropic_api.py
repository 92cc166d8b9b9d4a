"""Anthropic's Messages API through the official `anthropic` SDK against a real server.

Claude Code names Claude models; the server answers them through `--model-alias
'claude-*=<served>'`. Keys go as `x-api-key` (the SDK's `api_key`) or as a Bearer token
(its `auth_token`).
"""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest

from server.anthropic.errors import status_and_type
from server.errors import (
    APIError,
    BadRequest,
    Forbidden,
    InsufficientStorage,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    TooManyRequests,
    Unauthorized,
)
from server.settings import Settings
from tests.conftest import MODEL, ServerProcess
from tests.server.test_memory_guard import (
    MiB,
    StreamInBackground,
    reservation,
    set_ceiling_above_usage,
)

API_KEY, ADMIN_KEY = "sk-ant-test-key", "admin-test-key"
CLAUDE = "claude-sonnet-4-5-20250929"
VERSION = {"anthropic-version": "2023-06-01"}
MAX_BODY = 1 << 20
GREEDY = {"temperature": 0}  # this SDK no longer has a temperature argument; the API still does


@pytest.fixture(scope="module")
def proc(tiny_model_path, tmp_path_factory):
    p = ServerProcess(tiny_model_path, args=[
        "--model-alias", f"claude-*={MODEL}", "--api-key", API_KEY, "--admin-key", ADMIN_KEY,
        "--max-body-bytes", str(MAX_BODY),
    ]).start(tmp_path_factory.mktemp("anthropic"))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def client(proc):
    with anthropic.Anthropic(base_url=proc.url, api_key=API_KEY, max_retries=0) as c:
        yield c


def unique(text: str) -> str:
    """A prompt no earlier test sent, so the prefix cache holds none of it."""
    return f"{uuid.uuid4().hex[:8]} {text}"


def post(proc, body: dict, path: str = "/v1/messages", **headers: str) -> httpx.Response:
    return httpx.post(proc.url + path, json=body, timeout=60,
                      headers={"x-api-key": API_KEY, **VERSION, **headers})


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == kind
    assert body["error"]["message"]
    return body["error"]


def comparable(message) -> dict:
    """What must agree between a streamed and a non-streamed answer to the same request;
    the prefix cache may serve more of the prompt the second time, so the input counts
    are compared as a sum."""
    u = message.usage
    return {
        "content": [block.to_dict() for block in message.content],
        "stop_reason": message.stop_reason,
        "stop_sequence": message.stop_sequence,
        "output_tokens": u.output_tokens,
        "input": u.input_tokens + (u.cache_read_input_tokens or 0),
        "model": message.model,
        "role": message.role,
    }


def test_create_answers_a_message(client):
    m = client.messages.create(model=CLAUDE, max_tokens=12, extra_body=GREEDY,
                               messages=[{"role": "user", "content": unique("hello")}])
    assert m.type == "message" and m.role == "assistant" and m.model == CLAUDE
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 12
    assert m.usage.input_tokens > 0 and m.usage.cache_creation_input_tokens == 0


def test_system_as_string_and_as_blocks_make_the_same_prompt(client):
    question = [{"role": "user", "content": "What is two plus two?"}]
    as_string = client.messages.count_tokens(model=CLAUDE, system="Be brief.\n\nBe kind.",
                                             messages=question)
    as_blocks = client.messages.count_tokens(
        model=CLAUDE, messages=question,
        system=[{"type": "text", "text": "Be brief."},
                {"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}])
    folded = client.messages.count_tokens(
        model=CLAUDE, system="Be brief.",
        messages=[{"role": "system", "content": "Be kind."}, *question])  # type: ignore[list-item]
    without = client.messages.count_tokens(model=CLAUDE, messages=question)
    assert as_string.input_tokens == as_blocks.input_tokens == folded.input_tokens
    assert as_string.input_tokens > without.input_tokens
    m = client.messages.create(model=CLAUDE, max_tokens=4, extra_body=GREEDY, messages=question,
                               system=[{"type": "text", "text": unique("Be brief.")}])
    assert m.usage.output_tokens == 4


def test_stop_sequences_end_the_text_and_are_reported(client):
    messages = [{"role": "user", "content": unique("tell me a story")}]
    reference = client.messages.create(model=CLAUDE, max_tokens=40, extra_body=GREEDY,
                                       messages=messages).content[0].text
    stop = reference[20:23]
    expected = reference[:reference.find(stop)]
    m = client.messages.create(model=CLAUDE, max_tokens=40, extra_body=GREEDY, messages=messages,
                               stop_sequences=["never-in-gibberish", stop])
    assert m.stop_reason == "stop_sequence"
    assert m.stop_sequence == stop
    assert m.content[0].text == expected
    with client.messages.stream(model=CLAUDE, max_tokens=40, extra_body=GREEDY, messages=messages,
                                stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert comparable(streamed) == comparable(m)


def test_stream_events_in_documented_order_and_equal_to_create(client):
    request = {"model": CLAUDE, "max_tokens": 16, "extra_body": GREEDY,
               "system": "You answer briefly.",
               "messages": [{"role": "user", "content": unique("stream please")}]}
    with client.messages.create(stream=True, **request) as raw:
        kinds = [event.type for event in raw]  # the wire events, in order; the SDK drops pings
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    created = client.messages.create(**request)
    assert comparable(streamed) == comparable(created)
    assert streamed.usage.output_tokens == 16


def test_raw_stream_is_event_and_data_lines(proc):
    body = {"model": CLAUDE, "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", proc.url + "/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": API_KEY, **VERSION}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = r.read().decode().strip().split("\n\n")
    kinds = []
    for frame in frames:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
        kinds.append(event[7:])
    deltas = kinds.count("content_block_delta")  # one per token, fewer when bytes join
    assert 1 <= deltas <= 3
    assert kinds == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]


def test_count_tokens_equals_the_input_tokens_a_request_reports(client):
    """As with Anthropic, `input_tokens` leaves out what was read from the cache; every
    prompt here shares at least the chat template's opening with earlier ones."""
    request = {"model": CLAUDE, "system": "sys",
               "messages": [{"role": "user", "content": unique("count me")},
                            {"role": "assistant", "content": "ok"},
                            {"role": "user", "content": [{"type": "text", "text": "again"}]}]}
    counted = client.messages.count_tokens(**request).input_tokens
    m = client.messages.create(max_tokens=2, **request)
    assert m.usage.cache_read_input_tokens < 20
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted
    with client.messages.stream(max_tokens=2, **request) as stream:
        u = stream.get_final_message().usage
    assert u.input_tokens + u.cache_read_input_tokens == counted


def test_prefix_cache_hits_are_cache_read_input_tokens(client):
    shared = unique("a long shared preamble " * 40)
    first = client.messages.create(model=CLAUDE, max_tokens=2,
                                   messages=[{"role": "user", "content": shared + " one"}])
    second = client.messages.create(model=CLAUDE, max_tokens=2,
                                    messages=[{"role": "user", "content": shared + " two"}])
    assert first.usage.cache_read_input_tokens < 20
    assert second.usage.cache_read_input_tokens > len(shared) // 2
    counted = client.messages.count_tokens(
        model=CLAUDE, messages=[{"role": "user", "content": shared + " two"}]).input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == counted


def test_bearer_token_works_too(proc):
    with anthropic.Anthropic(base_url=proc.url, auth_token=API_KEY, max_retries=0) as c:
        m = c.messages.create(model=CLAUDE, max_tokens=2,
                              messages=[{"role": "user", "content": "hi"}])
    assert m.usage.output_tokens == 2


def test_models_list_in_anthropic_shape(client, proc):
    page = client.models.list()
    assert [m.id for m in page.data] == [MODEL]
    assert page.data[0].type == "model" and page.data[0].display_name == MODEL
    assert page.data[0].created_at.year >= 2024
    card = client.models.retrieve(CLAUDE)  # through the alias
    assert card.id == MODEL and card.type == "model"
    openai_shape = httpx.get(proc.url + "/v1/models", headers={"x-api-key": API_KEY}).json()
    assert openai_shape["object"] == "list" and openai_shape["data"][0]["object"] == "model"


# Errors: each status in Anthropic's shape.

def test_400_invalid_request(proc):
    assert_anthropic_error(post(proc, {"model": CLAUDE, "messages": [{"role": "user", "content": "x"}]}),
                           400, "invalid_request_error")
    assert_anthropic_error(post(proc, {"model": CLAUDE, "max_tokens": 0, "messages": []}),
                           400, "invalid_request_error")
    err = assert_anthropic_error(
        post(proc, {"model": CLAUDE, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
        ]}]}), 400, "invalid_request_error")
    assert "image" in err["message"] and "messages[0].content[1]" in err["message"]
    assert MODEL in err["message"]
    # A block whose type is not a string is malformed, not an unknown type to skip (found by
    # schemathesis: it was a 500).
    for kind in (["text"], {"a": 1}, 3):
        assert_anthropic_error(post(proc, {"model": CLAUDE, "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": kind, "text": "hi"}]}]}), 400, "invalid_request_error")


def test_sdk_raises_its_own_error_classes(client):
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="gpt-4o", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert exc.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "--model-alias" in exc.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=CLAUDE, max_tokens=2, extra_body={"temperature": 1.5},
                               messages=[{"role": "user", "content": "x"}])


def test_401_403_404_413_in_anthropic_shape(proc):
    body = {"model": CLAUDE, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    assert_anthropic_error(post(proc, body, **{"x-api-key": "wrong"}), 401, "authentication_error")
    r = httpx.post(proc.url + "/v1/messages", json=body)
    assert_anthropic_error(r, 401, "authentication_error")
    r = httpx.put(proc.url + "/v1/memory-guard", json={"tier": "safe"},
                  headers={"x-api-key": API_KEY, **VERSION})
    assert_anthropic_error(r, 403, "permission_error")
    r = post(proc, body, host="evil.example")  # DNS rebinding: the host guard refuses it
    assert_anthropic_error(r, 403, "permission_error")
    r = httpx.get(proc.url + "/v1/messages/batches", headers={"x-api-key": API_KEY})
    assert_anthropic_error(r, 404, "not_found_error")
    assert_anthropic_error(post(proc, {**body, "model": "claude"}), 404, "not_found_error")
    huge = {**body, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    assert_anthropic_error(post(proc, huge), 413, "request_too_large")
    # the same refusal on an OpenAI route keeps OpenAI's shape
    r = httpx.post(proc.url + "/v1/chat/completions", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "type" not in r.json()


@pytest.mark.parametrize(("error", "status", "kind"), [
    (BadRequest("x"), 400, "invalid_request_error"),
    (Unauthorized("x"), 401, "authentication_error"),
    (Forbidden("x"), 403, "permission_error"),
    (NotFound("x"), 404, "not_found_error"),
    (PayloadTooLarge("x"), 413, "request_too_large"),
    (TooManyRequests("x"), 429, "rate_limit_error"),
    (APIError("x"), 500, "api_error"),
    (RequestTimeout("x"), 504, "timeout_error"),
    (InsufficientStorage("x", headers={"x-should-retry": "false"}), 507, "insufficient_memory"),
    (InsufficientStorage("x", headers={"x-should-retry": "true", "Retry-After": "5"}), 529,
     "overloaded_error"),
])
def test_status_table(error, status, kind):
    assert status_and_type(error) == (status, kind)


def test_429_when_the_queue_is_full(start_server):
    p = start_server(args=["--max-concurrency", "1", "--max-queue", "0"])
    running = StreamInBackground(p.url, "keep busy", 400)
    assert running.started.wait(60)
    r = httpx.post(p.url + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    running.join()
    assert running.finish == "length"  # it was still running when the 429 came
    assert_anthropic_error(r, 429, "rate_limit_error")
    assert r.headers["retry-after"]


def test_memory_refusal_is_507_with_the_numbers_and_no_retry(small_machine):
    p = small_machine
    set_ceiling_above_usage(p.url, 2 * MiB)
    for stream in (False, True):
        r = httpx.post(p.url + "/v1/messages", timeout=60, headers=VERSION, json={
            "model": MODEL, "max_tokens": 10, "stream": stream,
            "messages": [{"role": "user", "content": "y" * 3000}]})
        err = assert_anthropic_error(r, 507, "insufficient_memory")
        assert r.headers["x-should-retry"] == "false"
        assert err["estimated_bytes"] > err["limit_bytes"] > 0
        assert err["binding"] == "custom" and err["code"]
        assert "retry-after" not in r.headers
    openai_err = httpx.post(p.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "y" * 3000}]})
    assert openai_err.status_code == 507
    numbers = ("code", "estimated_bytes", "limit_bytes", "binding", "message")
    assert {k: err[k] for k in numbers} == {k: openai_err.json()["error"][k] for k in numbers}
    with anthropic.Anthropic(base_url=p.url, api_key="unused", max_retries=3) as c:
        with pytest.raises(anthropic.InternalServerError) as exc:
            c.messages.create(model=MODEL, max_tokens=10,
                              messages=[{"role": "user", "content": "z" * 3000}])
    assert exc.value.status_code == 507


def test_memory_wait_that_times_out_is_529_overloaded_with_retry_after(small_machine_short_wait):
    p = small_machine_short_wait
    set_ceiling_above_usage(p.url, reservation(1520) * 3 // 2 + MiB)
    first = StreamInBackground(p.url, "f" * 1000, 500)  # holds its memory for 500 decode steps
    assert first.started.wait(60)
    r = httpx.post(p.url + "/v1/messages", timeout=60, headers=VERSION, json={
        "model": MODEL, "max_tokens": 500, "messages": [{"role": "user", "content": "s" * 1000}]})
    err = assert_anthropic_error(r, 529, "overloaded_error")
    assert r.headers["x-should-retry"] == "true"
    assert int(r.headers["retry-after"]) >= 1
    assert err["code"] == "memory_wait_timeout" and err["estimated_bytes"] > 0
    first.join()
    assert first.finish == "length"


def test_unknown_fields_and_blocks_are_logged_at_debug_without_text(start_server):
    p = start_server(args=["--log-level", "debug"])
    secret = "do-not-log-this-prompt"
    blocks = [{"type": "hologram", "text": secret}, {"type": "text", "text": secret}]
    r = post(p, {"model": MODEL, "max_tokens": 2, "brand_new_option": {"x": 1},
                 "messages": [{"role": "user", "content": blocks}]})
    assert r.status_code == 200, r.text
    log = p.log()
    assert "'hologram'" in log and "brand_new_option" in log
    assert secret not in log


def test_max_tokens_is_a_ceiling_clamped_to_the_context_room(tmp_path):
    """Claude Code asks for 32000 tokens whatever the model; the answer stops at the context
    (a tiny model with a 512-token context keeps this quick), or at the server's cap."""
    from engine.tiny_model import TinyModelShape, build_tiny_model

    model = build_tiny_model(tmp_path / "short", TinyModelShape(max_position_embeddings=512))
    p = ServerProcess(model, env={"MLX_HEADROOM_MAX_TOKENS_CAP": "20000"}).start(tmp_path)
    finals = []
    try:
        with anthropic.Anthropic(base_url=p.url, api_key="unused", max_retries=0) as c:
            messages = [{"role": "user", "content": "p" * 300}]
            counted = c.messages.count_tokens(model=MODEL, messages=messages).input_tokens
            # Sampled at temperature 1 (greedy, this random model ends its turn early), it
            # now and then samples the end of turn before the context is full (once in one
            # CI run): up to five answers, until one runs to the end.
            while len(finals) < 5 and not any(m.stop_reason == "max_tokens" for m in finals):
                with c.messages.stream(model=MODEL, max_tokens=32000, messages=messages) as stream:
                    finals.append(stream.get_final_message())
    finally:
        p.stop()
    room = 512 - counted
    assert [m.stop_reason for m in finals][-1] == "max_tokens"
    assert finals[-1].usage.output_tokens == room
    assert all(m.usage.output_tokens < room for m in finals[:-1])  # the early ends stopped short


def test_a_failure_after_the_stream_started_is_an_error_event(start_server):
    p = start_server(args=["--request-timeout-s", "1"])
    with anthropic.Anthropic(base_url=p.url, api_key="unused", max_retries=0) as c:
        with pytest.raises(anthropic.APIStatusError) as exc:
            with c.messages.stream(model=MODEL, max_tokens=8000,
                                   messages=[{"role": "user", "content": "go on"}]) as stream:
                for _ in stream:
                    pass
    assert exc.value.body["type"] == "error"  # type: ignore[index]
    assert exc.value.body["error"]["type"] == "timeout_error"  # type: ignore[index]


@pytest.mark.parametrize(("given", "expected"), [
    ("claude-*=served,haiku=served", {"claude-*": "served", "haiku": "served"}),
    ('{"claude-opus-4-1": "served"}', {"claude-opus-4-1": "served"}),
    (["*=served"], {"*": "served"}),
])
def test_model_aliases_setting(given, expected):
    assert Settings(served_model_name="served", model_aliases=given).model_aliases == expected


@pytest.mark.parametrize("given", [["no-equals-sign"], ["claude-*=someone-else"], "=served"])
def test_model_aliases_must_name_the_served_model(given):
    with pytest.raises(ValueError, match="alias"):
        Settings(served_model_name="served", model_aliases=given)


def test_an_alias_to_another_model_refuses_to_start(tiny_model_path, capsys):
    # the command's own function: it refuses before anything loads, with status 2
    from server.cli import main

    assert main(["serve", "--model", str(tiny_model_path), "--model-alias", "claude-*=gpt-4o"]) == 2
    assert "gpt-4o" in capsys.readouterr().err


def test_aliases_hold_on_the_openai_routes_too(proc):
    r = httpx.post(proc.url + "/v1/chat/completions", timeout=60, headers={"x-api-key": API_KEY},
                   json={"model": CLAUDE, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == CLAUDE
