"""Every error object, on every API, carries a non-null `code`."""

from __future__ import annotations

import httpx
import pytest

from server.anthropic.errors import error_body
from server.errors import APIError

MODEL = "mlx-headroom/tiny-chat"


def _classes(cls: type[APIError]) -> list[type[APIError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _classes(sub))]


@pytest.mark.parametrize("cls", _classes(APIError))
def test_an_error_raised_without_a_code_gets_its_class_default(cls):
    err = cls("something went wrong")
    assert err.body()["error"]["code"] == cls.default_code
    assert error_body(err)["error"]["code"] == cls.default_code
    assert cls("x", code="own").code == "own"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9], "max_tokens": 1}),
    ("/v1/responses", {"model": MODEL, "input": []}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": []}),
    ("/v1/messages", {"model": "nope", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/nowhere", {}),
])
def test_refusals_on_every_api_carry_a_code(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert isinstance(error["code"], str) and error["code"], error
