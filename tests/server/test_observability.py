"""Structured access logs (no prompt text unless asked) and Prometheus metrics."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess
from tests.server.test_errors_and_lifecycle import wait_until

MODEL = "mlx-headroom/tiny-chat"
ACCESS_FIELDS = {"request_id", "method", "path", "status", "prompt_tokens", "completion_tokens",
                 "ttft_s", "total_s", "admission"}


def complete_lines(log: str) -> list[str]:
    """The log's lines whose newline is written: a line read while the server is writing it
    is cut short, and is no JSON yet."""
    return [line[:-1] for line in log.splitlines(keepends=True) if line.endswith("\n")]


def access_lines(log: str) -> list[dict]:
    out = []
    for line in complete_lines(log):
        if '"mlx_headroom.access"' in line:
            out.append(json.loads(line))
    return out


def chat(url: str, secret: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": secret}], "max_tokens": 5,
            **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def line_for(proc, request_id: str) -> tuple[dict, str]:
    raw: list[str] = []

    def found() -> bool:
        raw[:] = [x for x in complete_lines(proc.log()) if request_id in x and "mlx_headroom.access" in x]
        return bool(raw)

    wait_until(found)
    return json.loads(raw[0]), raw[0]


def test_every_log_line_is_json(server):
    chat(server.url, "hi")
    lines = [x for x in complete_lines(server.log()) if x.strip()]
    assert lines
    for line in lines:
        record = json.loads(line)
        assert {"ts", "level", "logger", "message"} <= set(record)


def test_access_line_has_the_fields_and_no_prompt_text(server):
    secret = "zebra-quartz-7781"
    r = chat(server.url, secret)
    assert r.status_code == 200, r.text
    request_id = r.json()["id"].removeprefix("chatcmpl-")
    assert r.headers["x-request-id"] == request_id
    record, raw = line_for(server, request_id)
    assert set(record) >= ACCESS_FIELDS
    assert record["logger"] == "mlx_headroom.access"
    assert record["method"] == "POST" and record["path"] == "/v1/chat/completions"
    assert record["status"] == 200 and record["admission"] == "admitted"
    assert record["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert record["completion_tokens"] == 5
    assert 0 < record["ttft_s"] <= record["total_s"]
    assert secret not in raw
    assert r.json()["choices"][0]["message"]["content"] not in raw or not r.json()["choices"][0][
        "message"]["content"].strip()
    assert "prompt" not in record and "completion" not in record


def test_access_line_for_an_error_and_a_streamed_request(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400
    record, _ = line_for(server, r.headers["x-request-id"])
    assert record["status"] == 400 and record["admission"] is None
    assert record["error_code"] == "invalid_request"

    r = chat(server.url, "stream me", stream=True)
    record, _ = line_for(server, r.headers["x-request-id"])
    assert record["status"] == 200 and record["completion_tokens"] == 5
    assert record["admission"] == "admitted" and record["ttft_s"] is not None


def test_log_prompts_puts_the_text_in(start_server):
    proc = start_server(env={"MLX_HEADROOM_LOG_PROMPTS": "true"})
    secret = "walrus-lantern-4410"
    r = chat(proc.url, secret, temperature=0)
    record, _ = line_for(proc, r.headers["x-request-id"])
    assert secret in record["prompt"]
    assert record["completion"] == [r.json()["choices"][0]["message"]["content"]]


def test_a_refusal_is_logged_with_its_admission_outcome(small_machine):
    proc = small_machine
    # a 1000-byte machine: nothing fits
    guard = httpx.put(proc.url + "/v1/memory-guard", json={"tier": "custom", "ceiling_bytes": 1000})
    assert guard.status_code == 200, guard.text
    r = chat(proc.url, "hello")
    assert r.status_code == 507, r.text
    record, _ = line_for(proc, r.headers["x-request-id"])
    assert record["status"] == 507
    assert record["admission"] == "rejected:" + r.json()["error"]["code"]


def scrape(url: str) -> dict:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    family = families[name]
    for s in family.samples:
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, sample, labels))


def test_metrics_after_some_requests(server):
    before = scrape(server.url)
    base = value(before, "mlx_headroom_requests", endpoint="/v1/chat/completions", status="200") \
        if any(s.labels.get("endpoint") == "/v1/chat/completions" and s.labels.get("status") == "200"
               for s in before["mlx_headroom_requests"].samples) else 0
    completion_before = value(before, "mlx_headroom_completion_tokens",
                              "mlx_headroom_completion_tokens_total")
    for _ in range(3):
        assert chat(server.url, "count me", max_tokens=6).status_code == 200
    httpx.get(server.url + "/no/such/path")
    wait_until(lambda: value(scrape(server.url), "mlx_headroom_requests",
                             endpoint="/v1/chat/completions", status="200") >= base + 3)
    after = scrape(server.url)
    assert value(after, "mlx_headroom_requests", endpoint="other", status="404") >= 1
    assert value(after, "mlx_headroom_completion_tokens",
                 "mlx_headroom_completion_tokens_total") >= completion_before + 18
    assert value(after, "mlx_headroom_prompt_tokens", "mlx_headroom_prompt_tokens_total") > 0
    assert value(after, "mlx_headroom_time_to_first_token_seconds",
                 "mlx_headroom_time_to_first_token_seconds_count") >= 3
    assert value(after, "mlx_headroom_time_per_output_token_seconds",
                 "mlx_headroom_time_per_output_token_seconds_count") >= 3
    for state in ("waiting", "prefilling", "running"):
        assert value(after, "mlx_headroom_queue_depth", state=state) >= 0
    ceiling = value(after, "mlx_headroom_memory_ceiling_bytes")
    assert 0 < value(after, "mlx_headroom_memory_usage_bytes") < ceiling
    components = {s.labels["component"] for s in after["mlx_headroom_memory_ceiling_component_bytes"].samples}
    memory = httpx.get(server.url + "/v1/memory").json()
    assert components == set(memory["ceiling"]["components"])
    assert abs(ceiling - memory["ceiling"]["hard_bytes"]) < 0.1 * ceiling  # live, so it moves
    outcomes = {s.labels["outcome"]: s.value for s in after["mlx_headroom_admission_decisions"].samples
                if s.name.endswith("_total")}
    assert set(outcomes) == {"admit", "evict", "wait", "reject"}
    assert outcomes["admit"] >= 3
    for name in ("hits", "misses", "evictions"):
        assert f"mlx_headroom_prefix_cache_{name}" in after
    limit = value(after, "mlx_headroom_prefix_cache_max_bytes")
    assert value(after, "mlx_headroom_prefix_cache_bytes") <= limit
    hits = value(after, "mlx_headroom_prefix_cache_hits", "mlx_headroom_prefix_cache_hits_total")
    assert hits == memory["prefix_cache"]["hits"]


def test_metrics_registries_do_not_clash_between_apps():
    from server.app import create_app
    from server.settings import Settings

    a, b = create_app(Settings()), create_app(Settings())
    assert a.state.metrics.registry is not b.state.metrics.registry
    assert b"mlx_headroom_requests" in a.state.metrics.render()


def test_no_wired_limit_is_reported_where_setting_one_is_a_no_op(server):
    # Linux: mx.set_wired_limit does nothing, so the server reports null, not "0 wired"
    memory = httpx.get(server.url + "/v1/memory").json()
    assert "wired_limit_bytes" in memory["allocator"] and memory["allocator"]["wired_limit_bytes"] is None
    assert "mlx_headroom_wired_limit_bytes" not in scrape(server.url)


# The real CLI in a real process, on a device that wires: MLX's setter accepts every limit
# and the device reports a Mac's recommended working set (48 GiB).
WIRING_DEVICE = """
import sys
import engine.wired as wired

wired.WIRED.__init__(setter=lambda limit: 0, working_set=lambda: 48 << 30)
from server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_wired_limit_set_for_the_weights_is_reported(tiny_model_path, tmp_path):
    proc = ServerProcess(tiny_model_path, python_args=["-c", WIRING_DEVICE]).start(tmp_path)
    try:
        memory = httpx.get(proc.url + "/v1/memory").json()
        weights = memory["model"]["weight_bytes"]
        assert weights > 0 and memory["allocator"]["wired_limit_bytes"] == weights
        assert value(scrape(proc.url), "mlx_headroom_wired_limit_bytes") == weights
    finally:
        proc.stop()
