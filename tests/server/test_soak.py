"""A short soak (`python -m bench.soak`): mixed clients for a few seconds, then nothing may be left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # a soak: mixed clients for a fixed time


def test_short_soak_leaves_nothing_behind(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--duration", "12", "--concurrency", "6",
         "--log", str(tmp_path / "server.log")],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0, (summary, proc.stderr[-2000:])
    assert all(summary["checks"].values()), summary["checks"]
    assert summary["requests"] >= 20
    outcomes = summary["outcomes"]
    for kind in ("chat:200", "chat_stream:200", "disconnect:hung_up"):
        assert outcomes.get(kind, 0) > 0, outcomes
    assert summary["engine_after"] == {"queue": {"waiting": 0, "prefilling": 0, "running": 0},
                                       "committed_bytes": 0, "kv_bytes": 0}
    assert "Traceback" not in (tmp_path / "server.log").read_text()
