"""Every request in tests/server/claude_code_corpus/ gets 200, whole, streamed and counted.

The corpus holds request shapes that broke other local servers; see its README.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL, ServerProcess

CORPUS = sorted((Path(__file__).parent / "claude_code_corpus").glob("*.json"))
API_KEY = "sk-ant-corpus"
MAX_TOKENS = 6  # Claude Code asks for 32000; a few tokens show the request was served


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    """The tiny model with a 16k context: the huge tools list renders to ~8.6k of its
    byte-level tokens, past the default model's 8k."""
    from engine.tiny_model import TinyModelShape, build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-16k",
                             TinyModelShape(max_position_embeddings=16384))
    p = ServerProcess(model, args=[
        "--model-alias", f"claude-*={MODEL}", "--api-key", API_KEY,
    ]).start(tmp_path_factory.mktemp("corpus"))
    yield p
    p.stop()


def load(path: Path) -> tuple[dict, dict, str]:
    case = json.loads(path.read_text())
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01", **case["headers"]}
    return case["body"], headers, case.get("query", "")


def sse_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for frame in text.strip().split("\n\n"):
        event, data = frame.split("\n")
        events.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_the_corpus_covers_what_the_issue_names():
    names = {p.stem for p in CORPUS}
    assert {"system_role_in_messages", "cache_control_everywhere", "tool_result_is_error",
            "thinking_in_history", "unknown_block_types", "huge_tools_list"} <= names


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_corpus_request_is_served(proc, path):
    body, headers, query = load(path)
    url = f"{proc.url}/v1/messages?{query}"
    whole = httpx.post(url, headers=headers, timeout=300,
                       json={**body, "stream": False, "max_tokens": MAX_TOKENS})
    assert whole.status_code == 200, whole.text
    message = whole.json()
    assert message["type"] == "message" and message["model"] == body["model"]
    assert message["stop_reason"] in {"end_turn", "max_tokens", "tool_use"}
    assert message["usage"]["output_tokens"] >= 1

    streamed = httpx.post(url, headers=headers, timeout=300,
                          json={**body, "stream": True, "max_tokens": MAX_TOKENS})
    assert streamed.status_code == 200, streamed.text
    kinds = [kind for kind, _ in sse_events(streamed.text)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "error" not in kinds

    counted = httpx.post(f"{proc.url}/v1/messages/count_tokens?{query}", headers=headers, timeout=300,
                         json=body)
    assert counted.status_code == 200, counted.text
    usage = message["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
