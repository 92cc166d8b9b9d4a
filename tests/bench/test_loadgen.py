"""The load generator against a real server, so the benchmark harness does not rot."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.loadgen import Workload, chat_overhead, run_load
from bench.table import markdown
from engine.tiny_model import CHAT_TEMPLATE


def test_prompts_have_the_requested_token_count(tiny_model_path) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    assert "<|im_start|>" in CHAT_TEMPLATE  # the overhead below assumes ChatML
    for workload in (Workload(1, 100, 1), Workload(1, 400, 1, system_prompt="s" * 300)):
        ids = tokenizer.apply_chat_template(workload.messages(7), add_generation_prompt=True)
        assert len(ids) == workload.prompt_tokens
    assert chat_overhead(("user",)) == 19
    a, b = Workload(1, 64, 1).messages(0), Workload(1, 64, 1).messages(1)
    assert a[0]["content"][0] != b[0]["content"][0] or a[0]["content"][:7] != b[0]["content"][:7]


def test_loadgen_against_a_real_server(server) -> None:
    workload = Workload(3, 48, 5, requests=5, model="mlx-headroom/tiny-chat", timeout_s=30)
    report = asyncio.run(run_load(server.url, workload))
    s = report.summary()
    assert (s["ok"], s["failed"], s["dropped"]) == (5, 0, 0), s
    assert s["completion_tokens"] == 25
    assert s["output_tok_s"] > 0 and s["ttft_ms_p50"] > 0 and s["tpot_ms_p50"] > 0
    # three streams at once decode side by side for a while: a steady window, and its gaps
    s = asyncio.run(run_load(server.url, Workload(3, 48, 160, model="mlx-headroom/tiny-chat",
                                                  timeout_s=30))).summary()
    assert s["ok"] == 3 and s["steady_window_s"] > 0 and s["steady_tpot_ms_p50"] > 0, s
    # a 400 is counted as failed, by status
    bad = Workload(1, 48, -1, model="mlx-headroom/tiny-chat")
    s = asyncio.run(run_load(server.url, bad)).summary()
    assert s["failed"] == 1 and list(s["failed_by_status"]) in (["400"], ["422"])
    # a closed port is dropped
    s = asyncio.run(run_load("http://127.0.0.1:9", Workload(1, 48, 2), deadline_s=10)).summary()
    assert s["dropped"] == 1 and s["dropped_by_reason"] == {"ConnectError": 1}


def test_table_renders_a_results_file() -> None:
    point = {"concurrency": 1, "output_tok_s": 10.0, "ttft_ms_p50": 5.0, "ttft_ms_p95": 6.0,
             "tpot_ms_p50": 1.0, "tpot_ms_p95": 2.0, "ok": 1, "requests": 1}
    data = {"run": "x", "model": {"name": "tiny"}, "settings": {"sizes": {"prompt_tokens": 8}},
            "scenarios": {"throughput": {"ours": [point], "mlx_lm": [point]}}}
    text = markdown(json.loads(json.dumps(data)))
    assert "| throughput C=1, P=8, T=None | output tok/s (÷ physical bound) | 10.0 | 10.0 |" in text
    interference = {"itl_ms_p99": 120.0, "alone": {"itl_ms_p99": 9.0}, "late_short_ttft_ms": 80.0,
                    "long_ttft_ms": 1100.0, "long_idle_ttft_ms": 1000.0, "long_ttft_over_idle": 1.1,
                    "goals": {"itl_ms_p99": 150.0, "late_short_ttft_ms": 500.0, "long_ttft_over_idle": 1.2}}
    data["scenarios"] = {"interference": {"ours": interference}}
    data["settings"]["sizes"] |= {"interference_concurrency": 8, "interference_long_tokens": 100}
    text = markdown(json.loads(json.dumps(data)))
    label = "| interference, 8 streams × 8 tokens, one of 100 |"
    itl = "streams' ITL p99 ms alone / beside the long prefill (goal ≤ 150.0)"
    assert f"{label} {itl} | 9.0 / 120.0 |" in text
    assert f"{label} late short request's TTFT ms (goal ≤ 500.0) | 80 |" in text
    assert f"{label} long prompt's TTFT / idle ms (ratio, goal ≤ 1.2) | 1,100 / 1,000 (1.100) |" in text


def test_steady_tpot_counts_only_the_gaps_while_every_request_decodes() -> None:
    from bench.loadgen import RequestResult, steady_gaps

    a = RequestResult(0, outcome="ok", started=0.0, chunk_times=[0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    b = RequestResult(1, outcome="ok", started=2.5, chunk_times=[3.0, 3.5, 4.0, 4.5, 5.0, 9.0])
    dropped = RequestResult(2, outcome="dropped", chunk_times=[0.0, 100.0])
    gaps, _ = steady_gaps([a, b, dropped], concurrency=2)
    # a's gaps before b decodes (one of them while b prefills) and b's tail after a ended are out
    assert sorted(gaps) == [0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0]
    # one at a time (C=1): every gap of each request counts, as nothing else prefills meanwhile
    first = RequestResult(0, outcome="ok", started=0.0, chunk_times=[0.2, 0.3, 0.4])
    second = RequestResult(1, outcome="ok", started=0.5, chunk_times=[0.7, 0.9])
    gaps, covered = steady_gaps([first, second], concurrency=1)
    assert gaps == pytest.approx([0.1, 0.1, 0.2]) and covered == pytest.approx(0.4)
