"""macOS: a LaunchAgent per user (starts at login), or a LaunchDaemon with --system (starts
at boot, before anyone logs in).

The plist runs the installed console script with the serve flags given to `install`;
`KeepAlive` = {SuccessfulExit: false} restarts it when it exits with an error (the server
exits 1 when its engine dies) but not after a clean SIGTERM; `ThrottleInterval` spaces
restarts; `ExitTimeOut` gives the drain on SIGTERM time before launchd's SIGKILL. Loaded
with `launchctl bootstrap` / `bootout` (load/unload are deprecated).
"""

from __future__ import annotations

import os
import plistlib
import re
from pathlib import Path
from typing import Any

from server.service.base import (
    Context,
    ServicePaths,
    health_line,
    make_dir,
    print_install_plan,
    run,
    write_private,
    write_public,
)
from server.service.spec import LABEL, NAME, ServiceSpec

THROTTLE_INTERVAL_S = 10
EXIT_TIMEOUT_S = 60  # the server drains for up to 30 s (shutdown_grace_s) on SIGTERM
LOG_FILE = "server.log"


def paths(ctx: Context) -> ServicePaths:
    if ctx.system:
        return ServicePaths(
            config_file=ctx.under_root(f"/Library/LaunchDaemons/{LABEL}.plist"),
            env_file=ctx.under_root(f"/Library/Application Support/{NAME}/env"),
            log_dir=ctx.under_root(f"/Library/Logs/{NAME}"),
        )
    return ServicePaths(
        config_file=ctx.home / "Library/LaunchAgents" / f"{LABEL}.plist",
        env_file=ctx.home / "Library/Application Support" / NAME / "env",
        log_dir=ctx.home / "Library/Logs" / NAME,
    )


def render_plist(spec: ServiceSpec) -> bytes:
    assert spec.log_dir is not None
    log = str(spec.log_dir / LOG_FILE)
    plist: dict[str, Any] = {
        "Label": LABEL,
        "ProgramArguments": spec.arguments,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": THROTTLE_INTERVAL_S,
        "ExitTimeOut": EXIT_TIMEOUT_S,
        # No resource throttling (the default for daemons is "Standard"): it serves users.
        "ProcessType": "Interactive",
        "WorkingDirectory": str(spec.env_file.parent),
        "StandardOutPath": log,
        "StandardErrorPath": log,
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},  # nothing secret here
    }
    if spec.system and spec.run_as:
        plist["UserName"] = spec.run_as
    return plistlib.dumps(plist)


def _domain(ctx: Context) -> str:
    return "system" if ctx.system else f"gui/{os.getuid()}"


def install(ctx: Context, spec: ServiceSpec) -> int:
    p = paths(ctx)
    data = render_plist(spec)
    target = f"{_domain(ctx)}/{LABEL}"
    commands = [
        ["launchctl", "bootout", target],
        ["launchctl", "bootstrap", _domain(ctx), str(p.config_file)],
    ]
    if ctx.dry_run:
        print_install_plan(spec, p, data.decode(), commands)
        return 0
    assert p.log_dir is not None
    owner = spec.run_as if ctx.system else None
    make_dir(p.log_dir, owner=owner)
    write_private(p.env_file, spec.env_text(), owner=owner)
    write_public(p.config_file, data)
    run(commands[0], check=False)  # not loaded yet is fine
    run(commands[1])
    print(f"installed {p.config_file}; logs in {p.log_dir / LOG_FILE}")
    return 0


def uninstall(ctx: Context) -> int:
    p = paths(ctx)
    command = ["launchctl", "bootout", f"{_domain(ctx)}/{LABEL}"]
    if ctx.dry_run:
        print(f"# would run: {' '.join(command)}\n# would remove {p.config_file} and {p.env_file}")
        print("# dry run: nothing was removed or run")
        return 0
    run(command, check=False)
    for path in (p.config_file, p.env_file):
        if path.exists():
            path.unlink()
            print(f"removed {path}")
    print(f"kept the logs in {p.log_dir}")
    return 0


def status(ctx: Context) -> int:
    """Loaded? Running (pid)? Last exit status? What /health answers. 0 when running."""
    p = paths(ctx)
    if not p.config_file.exists():
        print(f"not installed ({p.config_file} does not exist)")
        return 3
    args = plistlib.loads(p.config_file.read_bytes()).get("ProgramArguments", [])
    result = run(["launchctl", "print", f"{_domain(ctx)}/{LABEL}"], check=False)
    if result.returncode != 0:
        print(f"installed: {p.config_file}\nloaded: no")
        print(health_line(args))
        return 3
    text = result.stdout
    state = _field(text, "state") or "unknown"
    pid = _field(text, "pid")
    last_exit = _field(text, "last exit code")
    print(f"installed: {p.config_file}\nloaded: yes")
    print(f"state: {state}" + (f" (pid {pid})" if pid else ""))
    if last_exit:
        print(f"last exit code: {last_exit}")
    print(health_line(args))
    return 0 if state == "running" else 3


def _field(text: str, name: str) -> str | None:
    match = re.search(rf"^\s*{re.escape(name)} = (.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else None


def logs(ctx: Context, lines: int, follow: bool) -> int:
    p = paths(ctx)
    assert p.log_dir is not None
    path = p.log_dir / LOG_FILE
    if not path.exists():
        print(f"no log yet at {path}")
        return 1
    cmd = ["tail", "-n", str(lines), *(["-f"] if follow else []), str(path)]
    os.execvp(cmd[0], cmd)
    return 0  # not reached


def log_path(ctx: Context) -> Path:
    p = paths(ctx)
    assert p.log_dir is not None
    return p.log_dir / LOG_FILE
