"""bench/chunk_cost.py times attention by chunk and context and writes what it printed."""

from __future__ import annotations

import json
from pathlib import Path

from bench import chunk_cost


def test_chunk_cost_times_every_chunk_at_every_context(tmp_path: Path, capsys) -> None:
    out = tmp_path / "chunk_cost.json"
    chunk_cost.main(["--parts", "attention", "--chunks", "16", "32", "--contexts", "0", "64",
                     "--dtype", "float32", "--iters", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["tokens"]) for r in rows] == [(0, 16), (0, 32), (64, 16), (64, 32)]
    assert all(r["causal_ms"] > 0 and r["padded_ms"] > 0 for r in rows)
    assert rows[2]["padded_keys"] == 256  # 80 keys padded to the smallest bucket
    assert len(capsys.readouterr().out.splitlines()) == 4


def test_the_store_part_times_each_variant_of_the_served_path(capsys) -> None:
    """The whole model through the engine's store, on a small llama: each variant at each
    chunk and context, first and warm."""
    cfg = {**chunk_cost.LLAMA_8B, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
    import mlx.core as mx

    rows = chunk_cost.store_rows(cfg, [150], [0, 300], mx.float32, iters=1)
    assert [(r["context"], r["tokens"]) for r in rows] == [(0, 150), (300, 150)]
    for r in rows:
        assert set(r) - {"part", "context", "tokens"} == set(chunk_cost.STORE_VARIANTS)
        assert all(v["ms"] > 0 and v["first_ms"] > 0 for k, v in r.items() if k in chunk_cost.STORE_VARIANTS)
    assert rows[1]["padded_gather"]["keys"] == rows[1]["padded_view"]["keys"] == 512  # 450 keys padded
    assert len(capsys.readouterr().out.splitlines()) == 2
