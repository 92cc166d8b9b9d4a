"""Schemathesis against OpenAI's own OpenAPI document (not ours: fuzzing a server against
its own spec is circular), for POST /chat/completions, POST /completions, GET /models and
GET /models/{model}.

The document is OpenAI's, trimmed to those operations (tests/openai_spec/, with its
source commit in `info.x-source`). Every schema-valid request must be served with a
response that validates against OpenAI's response schema (streamed chunks included), or
refused with an OpenAI error object that names the field it refuses (`param`).
Bounded for CI: a few dozen examples per operation, a small max_tokens cap.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.conftest import ServerProcess

SPEC_PATH = Path(__file__).resolve().parent.parent / "openai_spec" / "openai-trimmed.json"
MODEL = "mlx-headroom/tiny-chat"
MAX_EXAMPLES = {"POST /chat/completions": 40, "POST /completions": 30, "GET /models": 2,
                "GET /models/{model}": 2}
STREAM_SCHEMAS = {"/chat/completions": "CreateChatCompletionStreamResponse",
                  "/completions": "CreateCompletionResponse"}

pytestmark = pytest.mark.slow  # fuzzing against the OpenAI spec: a hundred generated requests


@pytest.fixture(scope="module")
def spec() -> dict:
    return json.loads(SPEC_PATH.read_text())


@pytest.fixture(scope="module")
def spec_server(tiny_model_path, tmp_path_factory):
    proc = ServerProcess(tiny_model_path, env={
        "MLX_HEADROOM_MAX_TOKENS_CAP": "16",
        "MLX_HEADROOM_DEFAULT_MAX_TOKENS": "8",
        "MLX_HEADROOM_REQUEST_TIMEOUT_S": "30",
        "MLX_HEADROOM_MAX_QUEUE": "256",
    }).start(tmp_path_factory.mktemp("openai-spec"))
    yield proc
    assert "Traceback" not in proc.log(), proc.log()[-4000:]
    proc.stop()


def stream_validator(spec: dict, path: str):
    schema = {"$ref": f"#/components/schemas/{STREAM_SCHEMAS[path]}", "components": spec["components"]}
    return jsonschema_rs.validator_for(schema)


def check(case, url: str, counts: dict[int, int], stream_check) -> None:
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL  # a random model name is a 404 before anything runs
    if case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = MODEL
    response = case.call(base_url=url + "/v1", timeout=60)
    where = f"{case.method} {case.path} -> {response.status_code}: {response.text[:400]}"
    counts[response.status_code] = counts.get(response.status_code, 0) + 1
    if response.status_code >= 400:
        assert response.status_code == 400, where
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", where
        assert error["param"], where  # the refusal names the field
        return
    if "text/event-stream" in response.headers.get("content-type", ""):
        assert stream_check is not None, where
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, where
                errors = [e.message for e in stream_check.iter_errors(event)]
                assert not errors, f"{where}\n{errors[:3]}\n{line[:400]}"
        return
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])


def make_fuzz(operation, url: str, counts: dict[int, int], stream_check):
    @given(case=operation.as_strategy(GenerationMode.POSITIVE))
    @settings(max_examples=MAX_EXAMPLES[operation.label], deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    def fuzz(case) -> None:
        check(case, url, counts, stream_check)

    return fuzz


def test_openai_spec_requests_are_served_or_refused_naming_the_field(spec, spec_server):
    schema = schemathesis.openapi.from_dict(spec)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert sorted(op.label for op in operations) == sorted(MAX_EXAMPLES)
    tally: dict[str, dict[int, int]] = {}
    for operation in operations:
        counts = tally.setdefault(operation.label, {})
        stream_check = stream_validator(spec, operation.path) if operation.path in STREAM_SCHEMAS else None
        fuzz = make_fuzz(operation, spec_server.url, counts, stream_check)
        fuzz()
    print(json.dumps(tally))
    for label, counts in tally.items():
        assert counts.get(200, 0) > 0, (label, counts)  # schema-valid requests are served
