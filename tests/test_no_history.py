"""The project speaks of itself, not of how it was built: no "session N" in code, docs or
tests, and no run labelled by one in a result (a result is named by date, machine and what
it measures: bench/results/<date>-<machine>-<scenario>/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("README.md", "bench", "docs", "engine", "memory", "server", "tests")
HISTORY = re.compile(r"session [0-9]|-s[0-9]+/", re.IGNORECASE)
# A run labelled by what it measures, e.g. gpu-20261202-182424-goals, not ...-goals-s15.
RUN_LABEL = re.compile(r"(?<=[a-z0-9])-s[0-9]{1,2}\b")


def files(suffixes: tuple[str, ...], under: tuple[str, ...] = SOURCES) -> list[Path]:
    found = []
    for name in under:
        path = ROOT / name
        candidates = [path] if path.is_file() else path.rglob("*")
        found += [p for p in candidates if p.is_file() and p.suffix in suffixes
                  and "__pycache__" not in p.parts]
    return sorted(found)


def test_no_session_numbers_in_code_docs_or_tests() -> None:
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in files((".py", ".md"))
           for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if HISTORY.search(line)]
    assert not bad, "development history in the product:\n" + "\n".join(bad)


def test_results_name_their_runs_by_what_they_measure() -> None:
    results = files((".json", ".jsonl", ".txt", ".log", ".md", ".sh"), ("bench/results",))
    assert results
    bad = [str(p.relative_to(ROOT)) for p in results if RUN_LABEL.search(p.read_text(errors="replace"))]
    assert not bad, "runs labelled by a session number:\n" + "\n".join(bad)
