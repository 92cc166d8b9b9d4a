"""``import memory`` must stay light: no web framework, no sibling layers, no MLX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import memory
from memory import *  # noqa
bad = [m for m in ("fastapi", "engine", "server", "mlx.core", "mlx") if m in sys.modules]
print(",".join(bad))
"""


def test_import_memory_loads_no_mlx_fastapi_engine_or_server() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"
