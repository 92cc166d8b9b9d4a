"""The record a supervised server leaves when a configuration error stops it.

launchd's `KeepAlive {SuccessfulExit: false}` restarts every non-zero exit, every
`ThrottleInterval` seconds, forever; it has no way to say "not after exit 2, 3 or 4" (systemd
has `RestartPreventExitStatus=`). So a launchd service runs `serve --fatal-file FILE`: on a
configuration error the server writes why to FILE and exits 0, which launchd does not
restart, and `service status` prints the record. A server that starts removes the file.
The exit codes themselves are listed once, in `server.cli`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

FILE_NAME = "last-fatal.json"


@dataclass(frozen=True)
class FatalRecord:
    exit_code: int  # what the server would have exited with
    reason: str
    at: float  # time.time()

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.at))
        return f"exit {self.exit_code} at {when}: {self.reason}"


def write(path: Path, exit_code: int, reason: str) -> None:
    """Write the record (whole or not at all: a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"exit_code": exit_code, "reason": reason, "at": time.time()}) + "\n")
    os.replace(tmp, path)


def read(path: Path) -> FatalRecord | None:
    """The record, or None when there is none (or it cannot be read)."""
    try:
        data = json.loads(path.read_text())
        return FatalRecord(int(data["exit_code"]), str(data["reason"]), float(data["at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear(path: Path) -> None:
    path.unlink(missing_ok=True)
