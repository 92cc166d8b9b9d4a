"""Errors as OpenAI error objects, disconnects, queue limits, a dead engine, and shutdown."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from tests.conftest import wait_until

MODEL = "mlx-headroom/tiny-chat"
MESSAGES = [{"role": "user", "content": "hello"}]


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": MODEL, "messages": MESSAGES, "temperature": 5}, "temperature"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "messages": MESSAGES, "top_logprobs": 3}, None),
        ({"model": MODEL, "messages": MESSAGES, "n": 100}, "n"),
        ({"model": MODEL, "messages": MESSAGES, "stop": ["x"] * 17}, "stop"),
        ({"messages": MESSAGES}, "model"),
    ],
)
def test_invalid_fields_are_400(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    err = assert_error(r, 400)
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert "JSON" in assert_error(r, 400)["message"]


def test_unknown_model_is_404(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES})
    assert_error(r, 404, "model_not_found")


def test_context_length_exceeded(server):
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 9000}]})
    assert_error(r, 400, "context_length_exceeded")
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL, "prompt": [1] * 8200, "max_tokens": 1})
    assert_error(r, 400, "context_length_exceeded")


def test_token_id_outside_vocabulary(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [1, 10**6]})
    assert_error(r, 400)


def test_bad_request_does_not_disturb_one_in_flight(server):
    async def run() -> tuple[str, list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0,
                    "stream": True}
            text = ""
            statuses = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        text += chunk["choices"][0]["delta"].get("content", "")
                        if len(statuses) < 5:
                            bad = await client.post("/v1/chat/completions", content=b"[",
                                                    headers={"content-type": "application/json"})
                            statuses.append(bad.status_code)
            return text, statuses

    text, statuses = asyncio.run(run())
    reference = httpx.post(f"{server.url}/v1/chat/completions",
                           json={"model": MODEL, "messages": MESSAGES, "max_tokens": 60,
                                 "temperature": 0}, timeout=60).json()
    assert statuses == [400] * 5
    assert text == reference["choices"][0]["message"]["content"]


def running(url: str) -> int:
    q = httpx.get(f"{url}/v1/memory").json()["queue"]
    return q["running"] + q["prefilling"] + q["waiting"]


def engine_counter(url: str, name: str) -> int:
    return httpx.get(f"{url}/v1/memory").json()["engine"][name]


LONG = 8000  # tokens: several seconds of decoding for the tiny model on this CPU


def test_streaming_disconnect_frees_the_request(server):
    wait_until(lambda: running(server.url) == 0)
    before = engine_counter(server.url, "generated_tokens")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": LONG, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
    wait_until(lambda: running(server.url) == 0)
    assert engine_counter(server.url, "generated_tokens") - before < LONG // 2
    assert httpx.get(f"{server.url}/v1/memory").json()["kv_bytes"] == 0


def test_non_streaming_disconnect_frees_the_request(server):
    wait_until(lambda: running(server.url) == 0)
    before = engine_counter(server.url, "generated_tokens")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": LONG}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await asyncio.to_thread(wait_until, lambda: running(server.url) == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())
    wait_until(lambda: running(server.url) == 0)
    assert engine_counter(server.url, "generated_tokens") - before < LONG // 2


def _read_and_then(response, action):
    """Yield every line of a stream (breaking out would close it), running `action` once
    the first chunk has arrived; its result comes last."""
    result = None
    for line in response.iter_lines():
        if line.startswith("data: {") and result is None:
            result = action()
        yield line
    yield result


def test_queue_full_is_429_with_retry_after(start_server):
    proc = start_server(env={"MLX_HEADROOM_MAX_CONCURRENCY": "1", "MLX_HEADROOM_MAX_QUEUE": "0"})
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "stream": True}
    with httpx.Client(base_url=proc.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = list(_read_and_then(r, lambda: client.post(
                "/v1/chat/completions", json={**body, "stream": False})))
    second = lines.pop()
    assert "data: [DONE]" in lines
    err = assert_error(second, 429, "queue_full")
    assert err["type"] == "rate_limit_error"
    assert int(second.headers["retry-after"]) >= 1


def test_sigterm_lets_in_flight_finish_then_exits_zero(start_server):
    proc = start_server()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True}
    got = []
    with httpx.Client(base_url=proc.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and not got:
                    proc.proc.send_signal(signal.SIGTERM)
                got.append(line)
    chunks = [json.loads(x[6:]) for x in got if x.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert got[-1] == "data: [DONE]" or "data: [DONE]" in got
    assert proc.proc.wait(30) == 0
    assert "Traceback" not in proc.log()
