"""A server process starts without paying for libraries it has not used yet.

`import server.app` leaves mlx-lm (and the transformers it imports, about 1.5 s on the CI
machine) to the model load; `import server.cli` is the command line alone, so that `serve`
re-executing itself on jemalloc, `service` and `doctor` start at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import {module}
print(",".join(m for m in {unwanted!r} if m in sys.modules))
"""


@pytest.mark.parametrize(("module", "unwanted"), [
    ("server.app", ("mlx_lm", "transformers", "huggingface_hub", "jinja2")),
    ("server.cli", ("uvicorn", "fastapi", "pydantic", "engine", "mlx", "numpy")),
])
def test_import_leaves_heavy_libraries_to_their_use(module: str, unwanted: tuple[str, ...]) -> None:
    code = SCRIPT.format(module=module, unwanted=unwanted)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import {module} imported: {out.stdout.strip()}"
