"""The service's log stays under its cap: `serve --log-file` rotates by size, and launchd's
own output file is trimmed at start when it has grown past the cap."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from server.log_file import log_to_file, trim_output_file


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    yield root
    for h in root.handlers:
        h.close()
    root.handlers[:] = saved
    root.setLevel(level)


def test_the_log_file_stays_under_its_cap_across_many_lines(tmp_path: Path, root_logger):
    path = tmp_path / "logs" / "server.log"
    cap, backups = 20_000, 2
    log_to_file(path, max_bytes=cap, backups=backups)
    log = logging.getLogger("mlx_headroom.access")
    for i in range(5_000):
        log.info("request %d done", i, extra={"status": 200, "tokens": i})
    files = sorted(path.parent.iterdir())
    assert [f.name for f in files] == ["server.log", "server.log.1", "server.log.2"]
    assert all(f.stat().st_size <= cap for f in files)
    assert sum(f.stat().st_size for f in files) <= cap * (backups + 1)
    last = path.read_text().splitlines()[-1]
    assert last == "INFO mlx_headroom.access request 4999 done"  # formatted as configured


def test_launchds_output_file_is_trimmed_to_its_end(tmp_path: Path):
    path = tmp_path / "server.stderr.log"
    path.write_bytes(b"".join(b"line %06d\n" % i for i in range(10_000)))  # 120,000 bytes
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # as launchd opens StandardErrorPath
    try:
        dropped = trim_output_file(fd, 10_000)
        os.write(fd, b"after\n")
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert dropped > 100_000 and len(data) <= 10_000
    lines = data.splitlines()
    assert lines[-2] == b"line 009999" and lines[-1] == b"after"
    assert lines[0].startswith(b"line ") and len(lines[0]) == 11  # from a line start


def test_a_small_or_unnamed_output_is_left_alone(tmp_path: Path):
    path = tmp_path / "small.log"
    path.write_bytes(b"x\n" * 10)
    with path.open("ab") as f:
        assert trim_output_file(f.fileno(), 1_000) == 0
    r, w = os.pipe()
    try:
        assert trim_output_file(w, 1) == 0
    finally:
        os.close(r)
        os.close(w)
