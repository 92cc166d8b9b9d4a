"""The load generator against a real server, so the benchmark harness does not rot."""

from __future__ import annotations

import asyncio
import json

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
    # a 400 is counted as failed, by status
    bad = Workload(1, 48, 0, model="mlx-headroom/tiny-chat")
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
    assert "| throughput C=1, P=8, T=None | output tok/s | 10.0 | 10.0 |" in text
