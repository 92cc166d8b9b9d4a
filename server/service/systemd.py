"""Linux: a systemd user unit (default), or a system unit with --system.

`Restart=on-failure` restarts the server when it exits with an error (it exits 1 when its
engine dies) but not after a clean stop, nor after a configuration error (exit 2: bad
settings, 3: the model cannot load, 4: it does not fit; `server.cli`), which a restart
cannot change. A port in use (exit 5) is restarted: the process this one replaces may still
hold it. `TimeoutStopSec` gives the drain on SIGTERM time
before systemd's SIGKILL. Logs go to the journal (`service logs` runs journalctl). A user
unit runs while its user is logged in; `loginctl enable-linger USER` keeps it running
without a session.
"""

from __future__ import annotations

import getpass
import os
import shlex

from server.service.base import (
    Context,
    ServicePaths,
    health_line,
    print_install_plan,
    run,
    write_private,
    write_public,
)
from server.service.spec import NAME, UNIT, ServiceSpec

# The same numbers as server.cli's (a test holds them equal); not imported from there, which
# would load the whole server (uvicorn) to write a unit file.
CONFIGURATION_ERRORS = frozenset({2, 3, 4})
EXIT_MEANINGS = {1: "the engine died; restarted", 2: "bad settings; not restarted",
                 3: "the server or its model could not start; not restarted",
                 4: "the model does not fit; not restarted",
                 5: "the port was in use; restarted"}

RESTART_SEC = 5
TIMEOUT_STOP_S = 60  # the server drains for up to 30 s (shutdown_grace_s) on SIGTERM


def paths(ctx: Context) -> ServicePaths:
    if ctx.system:
        return ServicePaths(
            config_file=ctx.under_root(f"/etc/systemd/system/{UNIT}"),
            env_file=ctx.under_root(f"/etc/{NAME}/env"),
            log_dir=None,
        )
    return ServicePaths(
        config_file=ctx.home / ".config/systemd/user" / UNIT,
        env_file=ctx.home / ".config" / NAME / "env",
        log_dir=None,
    )


def quote(arg: str) -> str:
    """One word of an ExecStart= line: specifiers (%) and variables ($) escaped, quoted when
    it holds spaces, quotes, backslashes or a ';' (systemd's command separator)."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(spec: ServiceSpec) -> str:
    service = [
        "Type=exec",
        "ExecStart=" + " ".join(quote(a) for a in spec.arguments),
        f"WorkingDirectory={quote(str(spec.env_file.parent))}",
        "Environment=PYTHONUNBUFFERED=1",
        "Restart=on-failure",
        # Configuration errors (server.cli.CONFIGURATION_ERRORS: bad settings, a model that
        # cannot load, one that does not fit): a restart cannot change them.
        "RestartPreventExitStatus=" + " ".join(str(c) for c in sorted(CONFIGURATION_ERRORS)),
        f"RestartSec={RESTART_SEC}",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={TIMEOUT_STOP_S}",
    ]
    if spec.system and spec.run_as:
        service.append(f"User={spec.run_as}")
    wanted_by = "multi-user.target" if spec.system else "default.target"
    return (
        "[Unit]\n"
        "Description=mlx-headroom: OpenAI-compatible MLX server with memory admission control\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n"
        "\n[Service]\n" + "".join(line + "\n" for line in service)
        + f"\n[Install]\nWantedBy={wanted_by}\n"
    )


def service_args(p: ServicePaths) -> list[str]:
    """The serve flags the unit adds: none (the journal keeps and rotates its logs)."""
    return []


def _systemctl(ctx: Context, *args: str) -> list[str]:
    return ["systemctl", *([] if ctx.system else ["--user"]), *args]


def install(ctx: Context, spec: ServiceSpec) -> int:
    p = paths(ctx)
    text = render_unit(spec)
    # restart, not start: a reinstall must replace a running server with the new flags
    commands = [_systemctl(ctx, "daemon-reload"), _systemctl(ctx, "enable", UNIT),
                _systemctl(ctx, "restart", UNIT)]
    if ctx.dry_run:
        print_install_plan(spec, p, text, commands)
        return 0
    # The server reads the file itself (--env-file), as the user it runs as.
    write_private(p.env_file, spec.env_text(), owner=spec.run_as if ctx.system else None)
    write_public(p.config_file, text.encode())
    for cmd in commands:
        run(cmd, tool=ctx.tool)
    print(f"installed {p.config_file}; logs: mlx-headroom service logs"
          + ("" if ctx.system else f" (to run without a login session: loginctl enable-linger {_user()})"))
    return 0


def _user() -> str:
    return getpass.getuser()


def uninstall(ctx: Context) -> int:
    p = paths(ctx)
    commands = [_systemctl(ctx, "disable", "--now", UNIT), _systemctl(ctx, "daemon-reload")]
    if ctx.dry_run:
        for cmd in commands:
            print("# would run: " + " ".join(cmd))
        print(f"# would remove {p.config_file} and {p.env_file}\n# dry run: nothing was removed or run")
        return 0
    run(commands[0], check=False, tool=ctx.tool)
    for path in (p.config_file, p.env_file):
        if path.exists():
            path.unlink()
            print(f"removed {path}")
    run(commands[1], check=False, tool=ctx.tool)
    return 0


def status(ctx: Context) -> int:
    """Loaded? Active (pid)? Last exit status? What /health answers. 0 when running."""
    p = paths(ctx)
    if not p.config_file.exists():
        print(f"not installed ({p.config_file} does not exist)")
        return 3
    exec_line = next((line for line in p.config_file.read_text().splitlines()
                      if line.startswith("ExecStart=")), "ExecStart=")
    args = shlex.split(exec_line.partition("=")[2].replace("%%", "%").replace("$$", "$"))
    props = "LoadState,ActiveState,SubState,MainPID,ExecMainStatus"
    result = run(_systemctl(ctx, "show", UNIT, f"--property={props}"), check=False, tool=ctx.tool)
    values = dict(line.partition("=")[::2] for line in result.stdout.splitlines() if "=" in line)
    loaded = values.get("LoadState") == "loaded"
    active = values.get("ActiveState", "unknown")
    print(f"installed: {p.config_file}\nloaded: {'yes' if loaded else 'no'}")
    pid = values.get("MainPID", "0")
    running = f" (pid {pid})" if pid not in ("", "0") else ""
    print(f"state: {active}/{values.get('SubState', '?')}{running}")
    if values.get("ExecMainStatus") not in (None, ""):
        code = values["ExecMainStatus"]
        meaning = EXIT_MEANINGS.get(int(code)) if code.isdigit() else None
        print(f"last exit code: {code}" + (f" ({meaning}; `mlx-headroom service logs` says why)"
                                           if meaning and active != "active" else ""))
    print(health_line(args))
    return 0 if active == "active" else 3


def logs(ctx: Context, lines: int, follow: bool) -> int:
    cmd = ["journalctl", *([] if ctx.system else ["--user"]), "-u", UNIT, "-n", str(lines),
           *(["-f"] if follow else [])]
    os.execvp(cmd[0], cmd)
    return 0  # not reached
