"""The physical bound (bench.bound.physical): the card's datasheet peaks against the model's
bytes and FLOPs, and `python -m bench table` printing each figure's fraction of it, read from
a committed H200 run (Llama-3-8B shape, bf16, 1,000-token prompts, 256 new tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bound import physical, physical_tok_s
from bench.table import markdown

RUN = Path(__file__).resolve().parents[2] / "bench/results/2026-12-04-h200-quantized/run.json"


def test_the_h200_bound_for_llama3_8b_is_the_weights_and_kv_at_bandwidth_and_prefill_at_peak() -> None:
    data = json.loads(RUN.read_text())
    phys = physical(data)
    assert phys is not None and phys["bytes_per_s"] == 4.8e12 and phys["flops"] == 989e12
    assert phys["kv_bytes_per_token"] == 131_072  # 2 × 32 layers × 8 KV heads × 128 × 2 bytes
    bound = {c: physical_tok_s(phys, prompt_tokens=1000, max_tokens=256, concurrency=c, requests=max(c, 2))
             for c in (1, 32, 64)}
    assert bound[1] == pytest.approx(290.7, abs=0.5)  # 16.1 GB of weights a step: 3.35 ms alone
    assert bound[32] == pytest.approx(5_026, abs=5)
    assert bound[64] == pytest.approx(6_825, abs=5)

    data["scenarios"]["prefill"] = {"ours": [{"prompt_tokens": 8000, "prefill_tok_s": 20_000.0,
                                              "ttft_ms_p50": 400.0}]}
    table = markdown(data)
    assert "| output tok/s (÷ physical bound) | 130.3 (0.448) | 79.8 (0.274) |" in table
    assert "| 2,979.3 (0.437) |" in table
    # 989 TFLOP/s over 2 × 8.03e9 FLOPs a token: 61,572 prompt tokens/s, an 8,000-token prompt in 130 ms
    assert "| tok/s (÷ peak FLOP/s at 2 × params a token) | 20,000.0 (0.325) |" in table
    assert "| prefill, one 8000-token prompt | TTFT p50 ms (bound ms) | 400 (130) |" in table


def test_no_bound_off_the_known_cards_or_on_quantized_weights() -> None:
    data = json.loads(RUN.read_text())
    cpu = {**data, "machine": {"backend": "cpu", "device_info": {}}}
    assert physical(cpu) is None
    assert "| output tok/s (÷ physical bound) | 130.3 | 79.8 |" in markdown(cpu)
    assert physical({**data, "model": {**data["model"], "dtype": None}}) is None
