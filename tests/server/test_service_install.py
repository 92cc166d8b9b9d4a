"""`mlx-headroom service install | uninstall | status | logs`: the real CLI, through its own
function in this process, and in a real process where it replaces itself (`logs` execs `tail`
or `journalctl`).

launchctl, systemctl and journalctl cannot run here, so the tests put recording stand-ins for them
first on PATH (they log their arguments and print what the real tool prints for
`launchctl print` / `systemctl show`). The files are checked for real: the plist with
plistlib, the unit with `systemd-analyze verify`, and the unit's ExecStart= is run to
serve a chat completion with the key from the 0600 environment file.
"""

from __future__ import annotations

import io
import os
import plistlib
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import httpx
import pytest

from tests.conftest import MODEL, ROOT, free_port, wait_until

LABEL = "com.mlx-headroom.server"
SECRET = "sk-test-not-in-any-config-file"

STAND_IN = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CALLS"
case "$1 $2" in
  "print "*/com.mlx-headroom.server)
    [ -n "$LAUNCHCTL_PRINT" ] || { echo "Could not find service" >&2; exit 113; }
    printf '%s\\n' "$LAUNCHCTL_PRINT" ;;
  "print "*) [ -z "$LAUNCHCTL_NO_GUI" ] || exit 113 ;;
  "show "*|"--user show") printf '%s\\n' "$SYSTEMCTL_SHOW" ;;
esac
"""


class Env:
    def __init__(self, tmp_path: Path) -> None:
        self.home = tmp_path / "home"
        self.bin = tmp_path / "bin"
        self.calls = tmp_path / "calls"
        self.bin.mkdir()
        for tool in ("launchctl", "systemctl", "journalctl"):
            path = self.bin / tool
            path.write_text(STAND_IN)
            path.chmod(0o755)
        self.extra: dict[str, str] = {}

    def environ(self) -> dict[str, str]:
        return {"HOME": str(self.home), "PATH": f"{self.bin}:{os.environ['PATH']}",
                "CALLS": str(self.calls), "PYTHONPATH": str(ROOT), **self.extra}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`mlx-headroom service ARGS` through `server.cli.main`, with this Env's variables
        (the stand-ins it runs see them too) and its output captured."""
        from server.cli import main

        out, err = io.StringIO(), io.StringIO()
        with mock.patch.dict(os.environ, self.environ()), redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(["service", *args])
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 2
        return subprocess.CompletedProcess(["service", *args], code, out.getvalue(), err.getvalue())

    def run_process(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The same command in its own process: for `logs`, which execs its tool."""
        return subprocess.run([sys.executable, "-m", "server.cli", "service", *args], cwd=ROOT,
                              env={**os.environ, **self.environ()}, capture_output=True, text=True,
                              timeout=60)

    def tool_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_launch_agent_plist_has_every_key(env):
    r = env.run("install", "--manager", "launchd", "--model", "/models/my model", "--port", "8123",
                "--memory-tier", "safe", "--api-key", SECRET)
    assert r.returncode == 0, r.stderr
    plist_path = env.home / "Library/LaunchAgents" / f"{LABEL}.plist"
    raw = plist_path.read_bytes()
    plist = plistlib.loads(raw)
    env_file = env.home / "Library/Application Support/mlx-headroom/env"
    logs = env.home / "Library/Logs/mlx-headroom"
    log = str(logs / "server.stderr.log")  # launchd's: what is written outside logging
    program = plist["ProgramArguments"]
    assert Path(program[0]).is_absolute() and os.access(program[0], os.X_OK)
    assert program[program.index("serve"):] == [
        "serve", "--env-file", str(env_file), "--log-file", str(logs / "server.log"),
        "--fatal-file", str(logs / "last-fatal.json"), "--model", "/models/my model", "--port",
        "8123", "--memory-tier", "safe"]
    assert plist == {
        "Label": LABEL,
        "ProgramArguments": program,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restarted after an error exit only
        "ThrottleInterval": 10,
        "ExitTimeOut": 60,  # longer than the 30 s drain on SIGTERM
        "ProcessType": "Interactive",
        "WorkingDirectory": str(env_file.parent),
        "StandardOutPath": log,
        "StandardErrorPath": log,
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
    }
    assert SECRET.encode() not in raw
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert f"MLX_HEADROOM_API_KEY={SECRET}" in env_file.read_text()
    assert Path(log).parent.is_dir()
    uid = os.getuid()
    assert env.tool_calls() == [f"launchctl print gui/{uid}",  # a GUI session: gui/<uid>
                                f"launchctl bootout gui/{uid}/{LABEL}",
                                f"launchctl print gui/{uid}/{LABEL}",  # gone: bootstrap
                                f"launchctl bootstrap gui/{uid} {plist_path}"]
    assert f"launchd domain: gui/{uid}" in r.stdout

    env.extra["LAUNCHCTL_PRINT"] = f"gui/{uid}/{LABEL} = {{\n\tstate = running\n\tpid = 4242\n}}"
    status = env.run("status", "--manager", "launchd")
    assert "loaded: yes" in status.stdout and "state: running (pid 4242)" in status.stdout
    assert "health: http://127.0.0.1:8123/health unreachable" in status.stdout
    assert status.returncode == 0

    del env.extra["LAUNCHCTL_PRINT"]  # booted out: gone
    r = env.run("uninstall", "--manager", "launchd")
    assert r.returncode == 0, r.stderr
    assert not plist_path.exists() and not env_file.exists()
    assert env.tool_calls()[-2:] == [f"launchctl bootout gui/{uid}/{LABEL}",
                                     f"launchctl print gui/{uid}/{LABEL}"]
    assert not any(" load" in c or "unload" in c for c in env.tool_calls())


def test_launch_daemon_runs_as_a_user_and_logs_under_library(env, tmp_path):
    root = tmp_path / "root"
    r = env.run("install", "--manager", "launchd", "--system", "--root", str(root),
                "--run-as", "daemon", "--model", "m", "--admin-key", SECRET)
    assert r.returncode == 0, r.stderr
    path = root / "Library/LaunchDaemons" / f"{LABEL}.plist"
    plist = plistlib.loads(path.read_bytes())
    log = str(root / "Library/Logs/mlx-headroom/server.stderr.log")
    assert plist["UserName"] == "daemon"
    assert (plist["StandardOutPath"], plist["StandardErrorPath"]) == (log, log)
    assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["RunAtLoad"] is True
    env_file = root / "Library/Application Support/mlx-headroom/env"
    assert env_file.stat().st_uid == int(subprocess.check_output(["id", "-u", "daemon"]))
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert env.tool_calls()[-1] == f"launchctl bootstrap system {path}"


def test_status_and_logs(env):
    r = env.run("status", "--manager", "launchd")
    assert r.returncode == 3 and "not installed" in r.stdout
    log = env.home / "Library/Logs/mlx-headroom/server.log"
    log.parent.mkdir(parents=True)
    log.write_text("one\ntwo\nthree\n")
    r = env.run_process("logs", "--manager", "launchd", "-n", "2")
    assert r.returncode == 0 and r.stdout == "two\nthree\n"
    r = env.run_process("logs", "--manager", "systemd", "-n", "5")
    assert r.returncode == 0 and env.tool_calls() == ["journalctl --user -u mlx-headroom.service -n 5"]


def test_dry_run_prints_the_file_and_changes_nothing(env, tmp_path):
    for manager in ("launchd", "systemd"):
        r = env.run("install", "--dry-run", "--manager", manager, "--model", "m", "--api-key", SECRET)
        assert r.returncode == 0, r.stderr
        assert "serve" in r.stdout and "nothing was written" in r.stdout
        assert SECRET not in r.stdout and "MLX_HEADROOM_API_KEY" in r.stdout
        if manager == "launchd":
            plist = plistlib.loads(r.stdout.split("\n", 1)[1].split("</plist>")[0].encode() + b"</plist>")
            assert plist["Label"] == LABEL
        else:
            assert "Restart=on-failure" in r.stdout
    assert all_files(env.home) == [] and env.tool_calls() == []


def test_install_refuses_flags_that_could_not_start(env):
    r = env.run("install", "--manager", "systemd", "--model", "m", "--host", "0.0.0.0")
    assert r.returncode == 2 and "without an API key" in r.stderr
    r = env.run("install", "--manager", "systemd", "--memory-tier", "reckless")
    assert r.returncode == 2
    assert all_files(env.home) == [] and env.tool_calls() == []


def _verify(unit: Path, *, user: bool, runtime: Path) -> None:
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing: apt-get install systemd"
    cmd = ["systemd-analyze", *(["--user"] if user else []), "verify", str(unit)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    ours = [line for line in (r.stdout + r.stderr).splitlines() if unit.name in line]
    assert r.returncode == 0 and ours == [], r.stdout + r.stderr


def test_systemd_units_pass_systemd_analyze_verify(env, tmp_path):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    r = env.run("install", "--manager", "systemd", "--model", "/models/a b%c", "--api-key", SECRET)
    assert r.returncode == 0, r.stderr
    user_unit = env.home / ".config/systemd/user/mlx-headroom.service"
    text = user_unit.read_text()
    assert "Restart=on-failure" in text and "WantedBy=default.target" in text
    assert "RestartPreventExitStatus=2 3 4" in text  # no restart loop on configuration errors
    assert SECRET not in text
    assert stat.S_IMODE((env.home / ".config/mlx-headroom/env").stat().st_mode) == 0o600
    _verify(user_unit, user=True, runtime=runtime)
    assert env.tool_calls() == ["systemctl --user daemon-reload",
                                "systemctl --user enable mlx-headroom.service",
                                "systemctl --user restart mlx-headroom.service"]

    root = tmp_path / "root"
    r = env.run("install", "--manager", "systemd", "--system", "--root", str(root),
                "--run-as", "daemon", "--model", "m")
    assert r.returncode == 0, r.stderr
    system_unit = root / "etc/systemd/system/mlx-headroom.service"
    text = system_unit.read_text()
    assert "User=daemon" in text and "WantedBy=multi-user.target" in text
    _verify(system_unit, user=False, runtime=runtime)
    # A broken unit does fail the check (the check is not vacuous).
    broken = tmp_path / "broken" / "mlx-headroom.service"
    broken.parent.mkdir()
    broken.write_text(text.replace("Restart=on-failure", "Restart=sometimes"))
    with pytest.raises(AssertionError):
        _verify(broken, user=False, runtime=runtime)


def test_the_units_command_serves_with_the_key_from_its_env_file(env, tiny_model_path, tmp_path):
    port = free_port()
    r = env.run("install", "--manager", "systemd", "--model", str(tiny_model_path), "--port", str(port),
                "--served-model-name", MODEL, "--api-key", SECRET)
    assert r.returncode == 0, r.stderr
    unit = (env.home / ".config/systemd/user/mlx-headroom.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(exec_start.partition("=")[2].replace("%%", "%").replace("$$", "$"))
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(argv, cwd=env.home, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 401
        ok = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {SECRET}"})
        assert ok.status_code == 200, ok.text
        env.extra["SYSTEMCTL_SHOW"] = (f"LoadState=loaded\nActiveState=active\nSubState=running\n"
                                       f"MainPID={proc.pid}\nExecMainStatus=0")
        status = env.run("status", "--manager", "systemd")
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"state: active/running (pid {proc.pid})" in status.stdout
        assert f"health: {url}/health -> 200" in status.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_a_relative_model_directory_is_made_absolute(tmp_path):
    from server.service.spec import absolute_paths

    (tmp_path / "models" / "tiny").mkdir(parents=True)
    argv = ["--model", "models/tiny", "--port", "1"]
    assert absolute_paths(argv, tmp_path) == ["--model", str(tmp_path / "models/tiny"), "--port", "1"]
    assert absolute_paths(["--model=models/tiny"], tmp_path) == [f"--model={tmp_path / 'models/tiny'}"]
    hub = ["--model", "mlx-community/Qwen3-8B-4bit"]  # not a directory here: a hub id
    assert absolute_paths(hub, tmp_path) == hub
