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


def test_a_quantized_points_weight_bandwidth_is_its_weights_over_the_steady_step() -> None:
    """Each decode step reads the quantized weights once, and the steady per-token time at a
    batch is that step's time: the bytes/s, and their share of the card's HBM bandwidth."""
    from bench import summary
    from bench.run import derived

    data = json.loads(RUN.read_text())
    data["quantized"]["weight_bytes"] = 4_500_000_000
    for p, ms in zip(data["scenarios"]["quantized"]["ours"], (9.0, 20.0, 30.0), strict=True):
        p["steady_tpot_ms_p50"] = ms
    derived(data)
    first = data["scenarios"]["quantized"]["ours"][0]
    assert first["weight_bytes_per_s"] == 500_000_000_000
    assert first["weight_bandwidth_fraction"] == round(5e11 / 4.8e12, 4)
    table = markdown(data)
    assert "| quantized 4-bit C=1, P=1000, T=256 | output tok/s | 114.6 |" in table
    assert ("| quantized 4-bit C=1, P=1000, T=256 | weights read per decode step, GB/s (÷ HBM bandwidth) "
            "| 500.0 (0.104) |") in table
    row = next(r for r in summary.rows(data) if r["scenario"] == "quantized" and r["concurrency"] == 64)
    assert (row["weight_gb_s"], row["weight_bandwidth_fraction"]) == (150.0, 0.0312)
    cpu = {**json.loads(RUN.read_text()), "machine": {"backend": "cpu", "device_info": {}}}
    cpu["quantized"]["weight_bytes"] = 4_500_000_000
    cpu["scenarios"]["quantized"]["ours"][0]["steady_tpot_ms_p50"] = 9.0
    derived(cpu)
    assert "weight_bandwidth_fraction" not in cpu["scenarios"]["quantized"]["ours"][0]  # no card, no share
