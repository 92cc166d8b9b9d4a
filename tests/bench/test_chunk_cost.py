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
