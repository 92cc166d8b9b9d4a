"""bench/qmm_repro.py, the standalone script for MLX's maintainers, runs as its docstring says
(MLX alone, no project import) and prints its three tables: one row per batch size, and
one per prefill row count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "qmm_repro.py"


def test_the_repro_script_times_both_forms_at_every_batch(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--batches", "1,8", "--k", "256", "--n", "512",
         "--experts", "4", "--top-k", "2", "--expert-dims", "256", "--dtype", "float32",
         "--prefill-rows", "16,64", "--iters", "2", "--warmup", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert "mx.quantized_matmul, weight 512×256" in out and "mx.gather_qmm, 4 experts" in out
    assert "Prefill rows, weight 512×256" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "8", "16", "64", "1", "8"], out
