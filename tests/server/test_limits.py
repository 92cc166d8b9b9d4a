"""Request limits: body size, messages and characters, the max_tokens cap, the deadline; CORS."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.conftest import ServerProcess

MODEL = "mlx-headroom/tiny-chat"
MESSAGES = [{"role": "user", "content": "hello"}]


def assert_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    return err


@pytest.fixture(scope="module")
def limited(tiny_model_path, tmp_path_factory):
    proc = ServerProcess(tiny_model_path, env={
        "MLX_HEADROOM_MAX_BODY_BYTES": "4096",
        "MLX_HEADROOM_MAX_MESSAGES": "3",
        "MLX_HEADROOM_MAX_PROMPT_CHARS": "200",
        "MLX_HEADROOM_MAX_TOKENS_CAP": "50",
    }).start(tmp_path_factory.mktemp("limited"))
    yield proc
    proc.stop()


def big_body(size: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "a" * size}).encode()


def test_body_over_the_limit_by_content_length(limited):
    r = httpx.post(limited.url + "/v1/completions", content=big_body(5000),
                   headers={"content-type": "application/json"})
    err = assert_error(r, 413, "request_too_large")
    assert err["type"] == "invalid_request_error"
    assert "4096" in err["message"]


def test_body_over_the_limit_without_content_length(limited):
    def chunks():
        body = big_body(20000)
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    r = httpx.post(limited.url + "/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "request_too_large")


def test_a_lying_content_length_cannot_smuggle_a_big_body(limited):
    """The server reads only the declared bytes; the rest is not part of this request."""
    body = big_body(5000)
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n" + body)
        head = s.recv(200)
    assert head.startswith(b"HTTP/1.1 400"), head


def test_body_under_the_limit_passes(limited):
    r = httpx.post(limited.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_too_many_messages(limited):
    r = httpx.post(limited.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MESSAGES * 4, "max_tokens": 2})
    assert assert_error(r, 400, "too_many_messages")["param"] == "messages"
    r = httpx.post(limited.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MESSAGES * 3, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_too_many_characters(limited):
    long = [{"role": "user", "content": "x" * 120}, {"role": "user", "content": "y" * 100}]
    r = httpx.post(limited.url + "/v1/chat/completions", json={"model": MODEL, "messages": long})
    assert "220 characters" in assert_error(r, 400, "prompt_too_long")["message"]
    r = httpx.post(limited.url + "/v1/completions", json={"model": MODEL, "prompt": "z" * 201})
    assert_error(r, 400, "prompt_too_long")


def test_max_tokens_above_the_cap_is_lowered_to_it_and_said(limited):
    """The operator's cap is a ceiling like the context's room: lowered to it, named in the
    header, never a 400 (agents send their own large ceilings)."""
    for field in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(limited.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": MESSAGES, field: 5000, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.headers["x-max-tokens-clamped"] == "50"
        assert r.json()["usage"]["completion_tokens"] <= 50
    r = httpx.post(limited.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "a", "max_tokens": 51, "temperature": 0})
    assert r.status_code == 200 and r.headers["x-max-tokens-clamped"] == "50"
    assert r.json()["usage"]["completion_tokens"] == 50
    r = httpx.post(limited.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "a", "max_tokens": 50, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 50
    assert "x-max-tokens-clamped" not in r.headers


def test_cors_is_off_by_default(limited):
    r = httpx.options(limited.url + "/v1/models", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(limited.url + "/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.fixture(scope="module")
def deadline(tiny_model_path, tmp_path_factory):
    proc = ServerProcess(tiny_model_path, env={
        "MLX_HEADROOM_REQUEST_TIMEOUT_S": "0.5",
        "MLX_HEADROOM_CORS_ORIGINS": "https://app.example,https://other.example",
        "MLX_HEADROOM_API_KEY": "k",
    }).start(tmp_path_factory.mktemp("deadline"))
    yield proc
    proc.stop()


AUTH = {"Authorization": "Bearer k"}


def engine_idle(url: str) -> bool:
    data = httpx.get(url + "/v1/memory", headers=AUTH).json()
    return sum(data["queue"].values()) == 0 and data["kv_bytes"] == 0 and data["committed_bytes"] == 0


def test_deadline_non_streaming_is_504_and_frees_the_engine(deadline):
    from tests.server.test_errors_and_lifecycle import wait_until

    r = httpx.post(deadline.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 8000})
    err = assert_error(r, 504, "request_timeout")
    assert err["type"] == "timeout_error"
    wait_until(lambda: engine_idle(deadline.url))


def test_deadline_streaming_ends_with_an_error_event_then_done(deadline):
    from tests.server.test_errors_and_lifecycle import wait_until

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8000, "stream": True}
    with httpx.stream("POST", deadline.url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])
    assert last["error"]["code"] == "request_timeout"
    assert len(data) > 3  # some tokens came before the deadline
    wait_until(lambda: engine_idle(deadline.url))


def test_short_requests_finish_within_the_deadline(deadline):
    r = httpx.post(deadline.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_cors_allows_only_the_configured_origins(deadline):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(deadline.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200, r.text  # answered before auth: preflights carry no key
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.get(deadline.url + "/v1/models", headers={**AUTH, "Origin": "https://other.example"})
    assert r.headers["access-control-allow-origin"] == "https://other.example"
    r = httpx.get(deadline.url + "/v1/models", headers={**AUTH, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(deadline.url + "/v1/models", headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400
    # an error answer carries the CORS headers too, so a browser can read it
    r = httpx.get(deadline.url + "/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
