"""Schemathesis against the server's own OpenAPI schema, through a real server process.

Bounded for CI: a few dozen cases per operation, and a server whose max_tokens cap is
small so that no generated request can make the tiny model run for long. Every answer
must be something other than a 500, and every error an OpenAI error object (Anthropic's
on /v1/messages), whether it comes as a status or as an event in a stream.
"""

from __future__ import annotations

import itertools
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.conftest import ServerProcess

ERROR_KEYS = {"message", "type", "param", "code"}
MODEL = "mlx-headroom/tiny-chat"
MAX_EXAMPLES = 25  # per operation and generation mode
DESIGNED_5XX = {503, 504, 507, 529}  # engine unavailable, request deadline, the memory guard

pytestmark = pytest.mark.slow  # fuzzing: hundreds of generated requests


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path, tmp_path_factory):
    proc = ServerProcess(tiny_model_path, env={
        "MLX_HEADROOM_MAX_TOKENS_CAP": "16",
        "MLX_HEADROOM_DEFAULT_MAX_TOKENS": "8",
        "MLX_HEADROOM_REQUEST_TIMEOUT_S": "20",
        "MLX_HEADROOM_MAX_QUEUE": "64",
    }).start(tmp_path_factory.mktemp("fuzz"))
    yield proc
    assert "Traceback" not in proc.log(), proc.log()[-4000:]
    proc.stop()


def assert_error_object(payload: object, where: str) -> None:
    assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), where
    assert set(payload["error"]) >= ERROR_KEYS, where
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"], where
    assert isinstance(payload["error"]["type"], str), where


def assert_anthropic_error(payload: object, where: str) -> None:
    assert isinstance(payload, dict) and payload.get("type") == "error", where
    assert isinstance(payload.get("error"), dict), where
    assert isinstance(payload["error"].get("type"), str), where
    assert isinstance(payload["error"].get("message"), str) and payload["error"]["message"], where


def check(case, url: str) -> None:
    response = case.call(base_url=url, timeout=60)
    where = f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    assert response.status_code != 500, where
    assert response.status_code < 500 or response.status_code in DESIGNED_5XX, where
    if case.path.startswith("/v1/messages"):
        if response.status_code >= 400:
            assert_anthropic_error(response.json(), where)
        elif "text/event-stream" in str(response.headers.get("content-type")):
            lines = response.text.splitlines()
            events = [(e[7:], json.loads(d[6:])) for e, d in itertools.pairwise(lines)
                      if e.startswith("event: ") and d.startswith("data: ")]
            assert events, where
            for name, data in events:
                assert data.get("type") == name, where
                if name == "error":
                    assert_anthropic_error(data, where)
        return
    if response.status_code >= 400:
        assert_error_object(response.json(), where)
    elif "text/event-stream" in str(response.headers.get("content-type")):
        # schemathesis stops reading a stream after some events, so [DONE] may not be here
        data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert data, where
        for item in data:
            event = json.loads(item) if item != "[DONE]" else {}
            if "error" in event:
                assert_error_object(event, where)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors_and_openai_error_objects(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "POST /v1/completions",
                                              "PUT /v1/memory-guard", "POST /v1/messages"}
    for operation in operations:
        @given(case=operation.as_strategy(mode))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # a random name is a 404 before anything runs
            check(case, fuzz_server.url)

        try:
            fuzz()
        except Unsatisfiable:
            # nothing to make invalid: an operation without parameters or a body
            assert mode is GenerationMode.NEGATIVE, operation.label
