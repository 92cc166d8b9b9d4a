"""What launchd and systemd share: where the files go, writing them, running the tool.

Every path hangs off `home` (user services) or `root` (system services), both injectable,
so tests install into a temporary directory with the real code path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from server.service.spec import ServiceSpec, health_url


@dataclass(frozen=True)
class ServicePaths:
    config_file: Path  # the plist or the unit
    env_file: Path  # secrets, 0600
    log_dir: Path | None  # launchd only


def run_tool(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run the supervisor's tool as it is (the default `Context.tool`), echoing the command."""
    print("+ " + " ".join(cmd))
    return subprocess.run(list(cmd), capture_output=True, text=True)


Tool = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class Context:
    """Where and how: the directories to install under, the supervisor's tool, and time.

    `tool`, `sleep` and `clock` are the seams: tests replay recorded launchctl answers and
    a fake clock, so the waits and retries run without a Mac and without sleeping."""

    home: Path
    root: Path = Path("/")
    system: bool = False
    dry_run: bool = False
    domain: str | None = None  # launchd: the domain asked for (--domain); None: chosen
    tool: Tool = run_tool
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def under_root(self, path: str) -> Path:
        return self.root / path.lstrip("/")


def write_private(path: Path, text: str, *, owner: str | None = None) -> None:
    """Write `text` to `path` readable by its owner only (0600), whatever was there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)
    if owner:
        _chown(path, owner)


def write_public(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o644)


def _chown(path: Path, user: str) -> None:
    import pwd

    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)


def make_dir(path: Path, *, owner: str | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if owner:
        _chown(path, owner)


def run(cmd: Sequence[str], *, check: bool = True,
        tool: Tool = run_tool) -> subprocess.CompletedProcess[str]:
    """Run the supervisor's tool; raise with its output on failure when `check`."""
    result = tool(cmd)
    if check and result.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed with status {result.returncode}: {output(result)}")
    return result


def output(result: subprocess.CompletedProcess[str]) -> str:
    return ((result.stderr or "") + (result.stdout or "")).strip()


def health_line(spec_args: Sequence[str]) -> str:
    """What /health answers, as one line."""
    url = health_url(spec_args)
    try:
        r = httpx.get(url, timeout=3)
    except httpx.HTTPError as exc:
        return f"health: {url} unreachable ({type(exc).__name__})"
    return f"health: {url} -> {r.status_code} {r.text.strip()}"


def print_install_plan(
    spec: ServiceSpec, paths: ServicePaths, config_text: str, commands: list[list[str]]
) -> None:
    """--dry-run: the file, the secrets file (names only), and the commands; nothing changes."""
    out = sys.stdout
    out.write(f"# {paths.config_file}\n{config_text}")
    if not config_text.endswith("\n"):
        out.write("\n")
    names = ", ".join(sorted(spec.secrets)) or "no keys"
    out.write(f"# {paths.env_file} (mode 0600): {names}\n")
    for cmd in commands:
        out.write("# would run: " + " ".join(cmd) + "\n")
    out.write("# dry run: nothing was written or run\n")
