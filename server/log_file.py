"""The server's own log file, capped in size: what a service writes for months.

launchd appends a job's stdout and stderr to its StandardOutPath/StandardErrorPath forever;
nothing rotates them. So a service runs `serve --log-file FILE`: the log's JSON lines go to
FILE through a `RotatingFileHandler` (FILE, FILE.1 … FILE.N, each at most `max_bytes`), and
launchd's file catches only what is written outside logging (a crash before logging starts,
a native abort). That file is trimmed at start when it has grown past the same cap, keeping
its end, where the last crash is. Prompt text stays out of both, as on stderr
(`--log-prompts` is the only way in).
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from logging.handlers import RotatingFileHandler
from pathlib import Path

log = logging.getLogger("mlx_headroom.server")


def log_to_file(path: Path, *, max_bytes: int, backups: int) -> RotatingFileHandler:
    """Send the root logger's lines (formatted as configured) to `path`, rotated by size,
    instead of stderr; trim stdout/stderr when they are files grown past `max_bytes`."""
    if max_bytes <= 0 or backups < 0:
        raise ValueError("--log-max-bytes must be positive and --log-backups at least 0")
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
    root = logging.getLogger()
    formatter = next((h.formatter for h in root.handlers if h.formatter is not None), None)
    if formatter is not None:
        handler.setFormatter(formatter)
    root.handlers[:] = [handler]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
        trimmed = trim_output_file(stream.fileno(), max_bytes)
        if trimmed:
            log.info("trimmed %d bytes from the start of the output file (fd %d)", trimmed,
                     stream.fileno())
    return handler


def trim_output_file(fd: int, max_bytes: int) -> int:
    """When `fd` is a regular file longer than `max_bytes`, keep its last `max_bytes // 2`
    bytes (from a line start) and drop the rest; return the bytes dropped. The file is
    reopened by its path (launchd opens it write-only, for appending, so later writes land
    at the new end)."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size <= max_bytes:
            return 0
        path = _path_of(fd)
        if path is None:
            return 0
        with open(path, "r+b") as f:
            if os.fstat(f.fileno()).st_ino != info.st_ino:
                return 0
            keep = max_bytes // 2
            f.seek(max(info.st_size - keep, 0))
            tail = f.read()
            newline = tail.find(b"\n")
            if 0 <= newline < len(tail) - 1:
                tail = tail[newline + 1:]
            f.seek(0)
            f.truncate()
            f.write(tail)
        os.lseek(fd, 0, os.SEEK_END)  # a descriptor not opened for appending writes on from here
    except OSError:
        return 0
    return info.st_size - len(tail)


def _path_of(fd: int) -> str | None:
    """The path an open file descriptor names: /proc on Linux, F_GETPATH on macOS."""
    if sys.platform == "darwin":
        import fcntl

        f_getpath = 50  # <sys/fcntl.h>
        raw = fcntl.fcntl(fd, f_getpath, b"\0" * 1024)
        return raw.split(b"\0", 1)[0].decode() or None
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
