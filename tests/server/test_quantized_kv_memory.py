"""Quantized KV through the server: load admission, the engine's store and GET /v1/memory
count the same quantized bytes. The tiny model holds float32 KV, 2 KiB per token; at 8
bits with groups of 32 (its head_dim) a row of 32 values takes 32 bytes plus a float32
scale and bias, 40 of 128 bytes."""

from __future__ import annotations

from pathlib import Path

import httpx

from memory import AllocatorProbe
from server.model_fit import admit_load
from server.settings import Settings

FULL_PER_TOKEN = 2048
Q8_PER_TOKEN = FULL_PER_TOKEN * 40 // 128
MODEL = "mlx-headroom/tiny-chat"
QUANTIZED = {"kv_bits": 8, "kv_group_size": 32}


def test_load_admission_reserves_the_quantized_kv(tiny_model_path: Path) -> None:
    full = admit_load(Settings(model=str(tiny_model_path)), AllocatorProbe())
    q8 = admit_load(Settings(model=str(tiny_model_path), **QUANTIZED), AllocatorProbe())
    assert full is not None and q8 is not None
    assert q8.report.load.reserve_tokens == full.report.load.reserve_tokens
    assert (q8.report.load.reserve_kv_bytes * FULL_PER_TOKEN
            == full.report.load.reserve_kv_bytes * Q8_PER_TOKEN)


def test_v1_memory_shows_the_quantized_kv(start_server, tiny_model_path: Path) -> None:
    proc = start_server(args=["--kv-bits", "8", "--kv-group-size", "32"])
    r = httpx.post(f"{proc.url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": "quantized keys and values " * 4,
                         "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    m = httpx.get(f"{proc.url}/v1/memory").json()
    assert (m["kv"]["bits"], m["kv"]["group_size"]) == (8, 32)
    assert m["kv"]["bytes_per_token"] == Q8_PER_TOKEN
    # the prefix cache keeps the prompt's blocks, so one segment of the CPU's 2,048 tokens stays
    assert m["kv"]["pool_bytes"] == 2048 * Q8_PER_TOKEN
    expected = admit_load(Settings(model=str(tiny_model_path), **QUANTIZED), AllocatorProbe())
    assert expected is not None
    assert m["model"]["load_check"]["reserve_kv_bytes"] == expected.report.load.reserve_kv_bytes
