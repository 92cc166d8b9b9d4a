"""`bench.machine.source_digest` names the code a result came from, whatever `.git` says."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench import machine


def test_the_digest_follows_the_code_not_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for package in ("engine", "memory", "server", "bench"):
        shutil.copytree(machine.ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(machine.ROOT / "pyproject.toml", tmp_path)
    monkeypatch.setattr(machine, "ROOT", tmp_path)
    first = machine.source_digest()
    assert machine.source_digest() == first
    runner = tmp_path / "engine" / "runner.py"
    runner.write_text(runner.read_text() + "\n# changed\n")
    assert machine.source_digest() != first
    assert machine.versions()["source_digest"] == machine.source_digest()
