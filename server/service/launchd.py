"""macOS: a LaunchAgent per user (starts at login), or a LaunchDaemon with --system (loaded
at boot; whether Metal serves it before anyone logs in is not verified: the server logs the
device it got at start, and `doctor` reports it).

The plist runs the installed console script with the serve flags given to `install`;
`KeepAlive` = {SuccessfulExit: false} restarts it when it exits with an error (the server
exits 1 when its engine dies) but not after a clean SIGTERM; `ThrottleInterval` spaces
restarts; `ExitTimeOut` gives the drain on SIGTERM time before launchd's SIGKILL.

launchd cannot be told "do not restart after exit 2, 3 or 4" (bad settings, a model that
cannot load, one that does not fit: they would fail again every 10 s, forever), so the
service runs `serve --fatal-file`: the server records why and exits 0 (`server.service.fatal`),
and `service status` prints the record.

Logs: the server writes its own log, size-capped and rotated (`serve --log-file`);
launchd's StandardOutPath/StandardErrorPath, which it appends to forever, catch only what
is written outside logging (a crash before logging starts, a native abort), and the server
trims that file at start when it has grown past the cap.

Domains: `system` for a LaunchDaemon; for an agent `gui/<uid>` when the user has a GUI
login session (`launchctl print gui/<uid>` succeeds), else `user/<uid>` (over SSH);
`--domain` overrides. Loaded with `launchctl bootstrap` / `bootout` (load/unload are
deprecated). `bootout` returns before the old job is gone, and a `bootstrap` then fails
with error 5 ("Input/output error"): install polls `launchctl print` until the job is gone
(at most `GONE_TIMEOUT_S`), and retries a `bootstrap` that fails with error 5 once.
"""

from __future__ import annotations

import os
import plistlib
import re
import subprocess
from pathlib import Path
from typing import Any

from server.service import fatal
from server.service.base import (
    Context,
    ServicePaths,
    health_line,
    make_dir,
    output,
    print_install_plan,
    run,
    write_private,
    write_public,
)
from server.service.spec import LABEL, NAME, ServiceSpec

THROTTLE_INTERVAL_S = 10
EXIT_TIMEOUT_S = 60  # the server drains for up to 30 s (shutdown_grace_s) on SIGTERM
LOG_FILE = "server.log"  # the server's own log, rotated (serve --log-file)
OUTPUT_FILE = "server.stderr.log"  # launchd's StandardOutPath/StandardErrorPath
GONE_TIMEOUT_S = 10.0  # how long install/uninstall wait for a booted-out job to go
GONE_POLL_S = 0.2
EIO = 5  # launchctl's "5: Input/output error"


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


def service_args(p: ServicePaths) -> list[str]:
    """The serve flags the plist adds: the rotated log and the fatal record."""
    assert p.log_dir is not None
    return ["--log-file", str(p.log_dir / LOG_FILE), "--fatal-file", str(p.log_dir / fatal.FILE_NAME)]


def render_plist(spec: ServiceSpec) -> bytes:
    assert spec.log_dir is not None
    log = str(spec.log_dir / OUTPUT_FILE)
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


def domain(ctx: Context) -> tuple[str, str]:
    """The launchd domain to use, and why."""
    if ctx.domain:
        return ctx.domain, "--domain"
    if ctx.system:
        return "system", "a LaunchDaemon"
    uid = os.getuid()
    gui = f"gui/{uid}"
    if ctx.tool(["launchctl", "print", gui]).returncode == 0:
        return gui, "this user has a GUI login session"
    return f"user/{uid}", "no GUI login session for this user (e.g. over SSH)"


def job_domain(ctx: Context) -> tuple[str, str]:
    """The domain an installed job is loaded in, for uninstall and status: a job installed
    over SSH sits in `user/<uid>` though the user may since have logged in at the screen (and
    the other way round), so both are asked before falling back to `domain`'s choice."""
    if ctx.domain or ctx.system:
        return domain(ctx)
    uid = os.getuid()
    for where in (f"gui/{uid}", f"user/{uid}"):
        if _loaded(ctx, f"{where}/{LABEL}"):
            return where, "the job is loaded there"
    return domain(ctx)


def _loaded(ctx: Context, target: str) -> bool:
    return ctx.tool(["launchctl", "print", target]).returncode == 0


def wait_gone(ctx: Context, target: str, timeout_s: float = GONE_TIMEOUT_S) -> bool:
    """Poll `launchctl print` until the job is gone; False when it is still there after
    `timeout_s`. `bootout` returns before launchd has finished removing the job."""
    deadline = ctx.clock() + timeout_s
    while _loaded(ctx, target):
        if ctx.clock() >= deadline:
            return False
        ctx.sleep(GONE_POLL_S)
    return True


def _is_eio(result: subprocess.CompletedProcess[str]) -> bool:
    return result.returncode == EIO or "Input/output error" in output(result)


def _sudo(ctx: Context) -> str:
    return "sudo " if ctx.system else ""


def install(ctx: Context, spec: ServiceSpec) -> int:
    p = paths(ctx)
    data = render_plist(spec)
    if ctx.dry_run:
        where = ctx.domain or ("system" if ctx.system else f"gui/{os.getuid()} or user/{os.getuid()}")
        commands = [["launchctl", "bootout", f"{where}/{LABEL}"],
                    ["launchctl", "bootstrap", where, str(p.config_file)]]
        print_install_plan(spec, p, data.decode(), commands)
        return 0
    where, why = domain(ctx)
    print(f"launchd domain: {where} ({why})")
    target = f"{where}/{LABEL}"
    assert p.log_dir is not None
    owner = spec.run_as if ctx.system else None
    make_dir(p.log_dir, owner=owner)
    write_private(p.env_file, spec.env_text(), owner=owner)
    write_public(p.config_file, data)
    fatal.clear(p.log_dir / fatal.FILE_NAME)  # new flags: the old record no longer applies
    booted_out = run(["launchctl", "bootout", target], check=False, tool=ctx.tool)
    if booted_out.returncode == 0 and not wait_gone(ctx, target):
        print(f"{target} is still present {GONE_TIMEOUT_S:.0f} s after bootout; bootstrapping anyway")
    bootstrap = ["launchctl", "bootstrap", where, str(p.config_file)]
    result = run(bootstrap, check=False, tool=ctx.tool)
    if result.returncode != 0 and _is_eio(result):
        print("launchctl bootstrap failed with error 5 (Input/output error): launchd is most "
              "likely still removing the previous job; waiting for it and retrying once")
        wait_gone(ctx, target)
        result = run(bootstrap, check=False, tool=ctx.tool)
    if result.returncode != 0:
        raise RuntimeError(
            f"launchctl bootstrap {where} failed with status {result.returncode}: {output(result)}. "
            f"If the job is still loaded (`{_sudo(ctx)}launchctl print {target}`), run "
            f"`{_sudo(ctx)}launchctl bootout {target}` and install again; `plutil -lint "
            f"{p.config_file}` checks the file")
    print(f"installed {p.config_file}; logs in {p.log_dir / LOG_FILE}")
    return 0


def uninstall(ctx: Context) -> int:
    """Boot the job out; remove the plist and the secrets only once it is gone (or was never
    loaded): a loaded job whose file is gone can only be removed by its label."""
    p = paths(ctx)
    if ctx.dry_run:
        where = ctx.domain or ("system" if ctx.system else f"gui/{os.getuid()}")
        print(f"# would run: launchctl bootout {where}/{LABEL}\n"
              f"# would remove {p.config_file} and {p.env_file}")
        print("# dry run: nothing was removed or run")
        return 0
    where, why = job_domain(ctx)
    print(f"launchd domain: {where} ({why})")
    target = f"{where}/{LABEL}"
    result = run(["launchctl", "bootout", target], check=False, tool=ctx.tool)
    gone = wait_gone(ctx, target)
    if not gone:
        problem = (f"bootout failed with status {result.returncode}: {output(result)}"
                   if result.returncode != 0 else f"still present {GONE_TIMEOUT_S:.0f} s after bootout")
        print(f"{target} is still loaded ({problem}); kept {p.config_file} and {p.env_file}. "
              f"Run `{_sudo(ctx)}launchctl bootout {target}`, then uninstall again")
        return 1
    for path in (p.config_file, p.env_file):
        if path.exists():
            path.unlink()
            print(f"removed {path}")
    print(f"kept the logs in {p.log_dir}")
    return 0


def status(ctx: Context) -> int:
    """Loaded? Running (pid)? Last exit status, and the last configuration error that
    stopped it? What /health answers. 0 when running."""
    p = paths(ctx)
    if not p.config_file.exists():
        print(f"not installed ({p.config_file} does not exist)")
        return 3
    args = plistlib.loads(p.config_file.read_bytes()).get("ProgramArguments", [])
    where, why = job_domain(ctx)
    target = f"{where}/{LABEL}"
    result = run(["launchctl", "print", target], check=False, tool=ctx.tool)
    assert p.log_dir is not None
    record = fatal.read(p.log_dir / fatal.FILE_NAME)
    if result.returncode != 0:
        print(f"installed: {p.config_file}\nloaded: no (in {where}: {why})")
        _print_fatal(record)
        print(health_line(args))
        return 3
    text = result.stdout
    state = _field(text, "state") or "unknown"
    pid = _field(text, "pid")
    last_exit = _field(text, "last exit code")
    print(f"installed: {p.config_file}\nloaded: yes ({target})")
    print(f"state: {state}" + (f" (pid {pid})" if pid else ""))
    if last_exit:
        print(f"last exit code: {last_exit}")
    if state != "running":
        _print_fatal(record)
    print(health_line(args))
    return 0 if state == "running" else 3


def _print_fatal(record: fatal.FatalRecord | None) -> None:
    if record is not None:
        print(f"stopped by a configuration error, not restarted ({record.describe()}); fix the "
              "flags and run `mlx-headroom service install` again")


def _field(text: str, name: str) -> str | None:
    match = re.search(rf"^\s*{re.escape(name)} = (.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else None


def logs(ctx: Context, lines: int, follow: bool) -> int:
    p = paths(ctx)
    assert p.log_dir is not None
    files = [str(f) for f in (p.log_dir / LOG_FILE, p.log_dir / OUTPUT_FILE) if f.exists()]
    if not files:
        print(f"no log yet at {p.log_dir / LOG_FILE}")
        return 1
    cmd = ["tail", "-n", str(lines), *(["-f"] if follow else []), *files]
    os.execvp(cmd[0], cmd)
    return 0  # not reached


def log_path(ctx: Context) -> Path:
    p = paths(ctx)
    assert p.log_dir is not None
    return p.log_dir / LOG_FILE
