"""The KeepAlive policy: a configuration error (exit 2, 3 or 4) must not become a restart
loop. launchd restarts every non-zero exit (`KeepAlive {SuccessfulExit: false}`), so the
service's server records why in its --fatal-file and exits 0; systemd's unit lists the
same codes in RestartPreventExitStatus=. A port in use (exit 5) is transient: restarted by
both, never recorded. The real CLI in a real process."""

from __future__ import annotations

import json
import os
import plistlib
import socket
import subprocess
from pathlib import Path

from server import cli, model_fit
from server.service import fatal, launchd, systemd
from server.service.base import Context
from server.service.spec import ServiceSpec
from tests import forkserver
from tests.conftest import ROOT, free_port


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`serve` to its end in a process of its own (tests/forkserver.py: a fork where it can)."""
    return forkserver.run(["serve", *args], cwd=ROOT, timeout=timeout)


def test_the_exit_codes_are_one_list():
    assert cli.CONFIGURATION_ERRORS == {cli.EXIT_BAD_SETTINGS, cli.EXIT_STARTUP_FAILED,
                                        cli.EXIT_DOES_NOT_FIT} == {2, 3, 4}
    assert systemd.CONFIGURATION_ERRORS == cli.CONFIGURATION_ERRORS
    assert (model_fit.EXIT_DOES_NOT_FIT, model_fit.EXIT_CANNOT_SIZE) == (cli.EXIT_DOES_NOT_FIT,
                                                                        cli.EXIT_STARTUP_FAILED)
    assert cli.EXIT_ENGINE_DIED not in cli.CONFIGURATION_ERRORS  # that one is restarted


def test_the_plist_runs_the_server_with_a_fatal_file(tmp_path):
    ctx = Context(home=tmp_path)
    p = launchd.paths(ctx)
    spec = ServiceSpec(program=("/bin/mlx-headroom",), serve_args=(), env_file=p.env_file,
                       log_dir=p.log_dir, service_args=tuple(launchd.service_args(p)))
    plist = plistlib.loads(launchd.render_plist(spec))
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # exit 0 is not restarted
    args = plist["ProgramArguments"]
    assert p.log_dir is not None
    assert args[args.index("--fatal-file") + 1] == str(p.log_dir / fatal.FILE_NAME)


def test_a_bad_flag_is_recorded_and_exits_zero(tmp_path: Path):
    record = tmp_path / "last-fatal.json"
    r = serve("--memory-tier", "reckless", "--fatal-file", str(record))
    assert r.returncode == 0, r.stderr
    found = fatal.read(record)
    assert found is not None and found.exit_code == 2 and "reckless" in found.reason
    assert "recorded in" in r.stderr
    # without --fatal-file (a terminal, systemd): the code itself
    assert serve("--memory-tier", "reckless").returncode == 2


def test_a_model_that_cannot_load_is_recorded_and_exits_zero(tmp_path: Path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    record = tmp_path / "last-fatal.json"
    record.write_text("stale")  # a server that starts removes the old record first
    r = serve("--model", str(empty), "--port", str(free_port()), "--fatal-file", str(record))
    assert r.returncode == 0, r.stderr[-3000:]
    found = fatal.read(record)
    assert found is not None and found.exit_code == 3, r.stderr[-3000:]
    assert found.reason and found.reason != "the server did not start"


def test_a_model_that_does_not_fit_is_recorded_and_exits_zero(tmp_path: Path):
    # the tiny preset under a 25 MB ceiling (the allocator probe): load admission refuses it
    record = tmp_path / "last-fatal.json"
    r = serve("--model", "tiny", "--load-format", "dummy", "--memory-probe", "allocator",
              "--memory-tier", "custom", "--memory-ceiling-bytes", "25000000",
              "--port", str(free_port()), "--fatal-file", str(record))
    assert r.returncode == 0, r.stderr[-3000:]
    found = fatal.read(record)
    assert found is not None and found.exit_code == cli.EXIT_DOES_NOT_FIT, r.stderr[-3000:]
    assert "does not fit" in found.reason


def test_a_port_in_use_is_restarted_by_both_supervisors(tmp_path: Path):
    assert cli.EXIT_PORT_IN_USE == 5 and cli.EXIT_PORT_IN_USE not in cli.CONFIGURATION_ERRORS
    spec = ServiceSpec(program=("/bin/mlx-headroom",), serve_args=(), env_file=tmp_path / "env")
    assert "RestartPreventExitStatus=2 3 4\n" in systemd.render_unit(spec)
    assert systemd.EXIT_MEANINGS[cli.EXIT_PORT_IN_USE] == "the port was in use; restarted"


def test_a_port_in_use_exits_5_and_is_not_recorded(tiny_model_path: Path, tmp_path: Path):
    """Another process holds the port: exit 5, which launchd's KeepAlive and systemd's
    Restart=on-failure restart, even under --fatal-file; the log names the address and us."""
    record = tmp_path / "last-fatal.json"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = serve("--model", str(tiny_model_path), "--port", str(port), "--fatal-file", str(record))
    assert r.returncode == cli.EXIT_PORT_IN_USE, r.stderr[-3000:]
    assert not record.exists(), record.read_text()
    lines = [json.loads(line) for line in r.stderr.splitlines() if "cannot listen on" in line]
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0]["message"].startswith(f"cannot listen on 127.0.0.1:{port}: address already in use "
                                          f"(held by pid {os.getpid()} (")
    assert lines[0]["port"] == port and lines[0]["level"] == "error"
