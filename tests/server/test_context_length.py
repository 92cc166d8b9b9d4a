"""`serve --context-length`: the served context governs every API, and raising it is allowed
only where the model's RoPE scaling reaches and the guard admits its memory (engine.context).

Real servers on the tiny model (8192 positions, plain RoPE), and on copies of it whose
config.json carries a yarn scaling of factor 2 over 8192 positions (16384) or over 2048 (4096).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import forkserver
from tests.conftest import MODEL, ROOT, ServerProcess, free_port

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
LONG = "x" * 600  # over 600 tokens: the tiny tokenizer is byte-level


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`mlx-headroom <args>` in a process of its own (tests/forkserver.py: a fork where it can)."""
    return forkserver.run(list(args), cwd=ROOT, timeout=240)


@pytest.fixture(scope="module")
def short(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model_path, args=["--context-length", "512"])
    try:
        yield proc.start(tmp_path_factory.mktemp("short"))
    finally:
        proc.stop()


def _yarn_copy(tiny_model_path: Path, folder: Path, positions: int) -> Path:
    path = shutil.copytree(tiny_model_path, folder / "tiny-yarn")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = positions
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0,
                              "original_max_position_embeddings": positions}
    (path / "config.json").write_text(json.dumps(config))
    return Path(path)


@pytest.fixture(scope="module")
def yarn_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _yarn_copy(tiny_model_path, tmp_path_factory.mktemp("yarn"), 8192)


@pytest.fixture(scope="module")
def short_yarn_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2048 positions raised to 4096: a prompt past the model's own positions prefills in a
    quarter of the time 8192 → 16384 takes on the CPU."""
    return _yarn_copy(tiny_model_path, tmp_path_factory.mktemp("short-yarn"), 2048)


def _clamped(r: httpx.Response) -> int:
    return int(r.headers["x-max-tokens-clamped"])


def test_a_lowered_context_is_what_the_models_list_says(short: ServerProcess) -> None:
    card = httpx.get(short.url + "/v1/models").json()["data"][0]
    assert card["context_length"] == 512
    anthropic = httpx.get(short.url + "/v1/models", headers={"anthropic-version": "2023-06-01"})
    assert anthropic.json()["data"][0]["max_input_tokens"] == 512


def test_a_prompt_over_the_lowered_context_is_refused_on_all_three_apis(short: ServerProcess) -> None:
    r = httpx.post(short.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in error["message"]
    r = httpx.post(short.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": [1] * 600, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert "512 tokens, and the prompt is 600 tokens" in r.json()["error"]["message"]
    r = httpx.post(short.url + "/v1/responses", timeout=60,
                   json={"model": MODEL, "input": LONG, "max_output_tokens": 16})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "512" in r.json()["error"]["message"]
    r = httpx.post(short.url + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": LONG}]})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "maximum context length is 512 tokens" in body["error"]["message"]


def test_max_tokens_is_clamped_to_what_the_lowered_context_leaves(short: ServerProcess) -> None:
    ask = [{"role": "user", "content": "Hi"}]
    r = httpx.post(short.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": ask, "max_tokens": 32000,
        "response_format": {"type": "json_schema", "json_schema": {"name": "done", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    assert _clamped(r) == 512 - r.json()["usage"]["prompt_tokens"]
    tool = {"name": "done", "input_schema": SCHEMA}
    r = httpx.post(short.url + "/v1/messages", timeout=120, json={
        "model": MODEL, "messages": ask, "max_tokens": 32000, "tools": [tool],
        "tool_choice": {"type": "tool", "name": "done", "disable_parallel_tool_use": True}})
    assert r.status_code == 200, r.text
    assert _clamped(r) == 512 - r.json()["usage"]["input_tokens"]


def test_raising_a_plain_rope_model_is_refused_at_start(tiny_model_path: Path) -> None:
    out = cli("serve", "--model", str(tiny_model_path), "--served-model-name", MODEL,
              "--context-length", "16384", "--port", str(free_port()))
    assert out.returncode == 2, out.stderr
    assert (f"--context-length 16384 exceeds {MODEL}'s context of 8192 tokens, and its RoPE has "
            "no scaling") in out.stderr
    assert "At most 8192." in out.stderr
    assert "loading model" not in out.stderr  # refused before any weights


def test_a_yarn_model_is_served_up_to_factor_times_original(short_yarn_model: Path, tmp_path: Path) -> None:
    out = cli("serve", "--model", str(short_yarn_model), "--context-length", "4097",
              "--port", str(free_port()))
    assert out.returncode == 2, out.stderr
    assert ("its context is 2048 tokens and its yarn RoPE scaling (factor 2 over 2048 original "
            "positions) extends it to 4096. At most 4096.") in out.stderr
    proc = ServerProcess(short_yarn_model, env={"MLX_HEADROOM_CONTEXT_LENGTH": "4096"}).start(tmp_path)
    try:
        assert httpx.get(proc.url + "/v1/models").json()["data"][0]["context_length"] == 4096
        # beyond the model's own 2048 positions: served
        r = httpx.post(proc.url + "/v1/completions", timeout=600,
                       json={"model": MODEL, "prompt": [1] * 2200, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 2200
        r = httpx.post(proc.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": [1] * 4096, "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert "maximum context length is 4096 tokens" in r.json()["error"]["message"]
        memory: dict[str, Any] = httpx.get(proc.url + "/v1/memory").json()["model"]
        assert memory["reserve_context_tokens"] == 4096  # the guard admitted all of it
    finally:
        proc.stop()


def test_a_raise_the_memory_ceiling_cannot_hold_is_refused_with_numbers(yarn_model: Path) -> None:
    """Load admission reserves KV for the whole raised context; on a 32 MB simulated machine
    (the allocator probe) that does not fit, while the context the refusal suggests does, and
    so does a shorter reserve of the same context."""
    ceiling = ["--memory-probe", "allocator", "--memory-tier", "custom",
               "--memory-ceiling-bytes", "32000000"]
    raised = ["--model", str(yarn_model), "--context-length", "16384", *ceiling]
    out = cli("serve", *raised, "--port", str(free_port()))
    assert out.returncode == 4, out.stderr
    assert "does not fit" in out.stderr
    assert "KV for 16384 reserved tokens 32.0 MiB" in out.stderr
    assert "the custom ceiling 30.5 MiB" in out.stderr
    assert "--reserve-context-tokens" in out.stderr  # what would fit
    fitting = re.search(r"a context that fits: --context-length (\d+)\.", out.stderr)
    assert fitting is not None, out.stderr
    out = cli("doctor", "--json", "--model", str(yarn_model), "--context-length", fitting.group(1),
              *ceiling)
    model = json.loads(out.stdout)["model"]
    assert model["context_length"] == int(fitting.group(1)) < 16384
    assert model["fit"]["fits"] is True, model["fit"]["message"]  # the advice holds
    out = cli("doctor", "--json", *raised, "--reserve-context-tokens", "4096")
    model = json.loads(out.stdout)["model"]
    assert model["context_length"] == 16384
    assert model["fit"]["fits"] is True, model["fit"]["message"]
    assert model["fit"]["reserve_context_tokens"] == 4096
