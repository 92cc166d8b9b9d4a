"""launchd's failure modes, replayed: `service install | uninstall | status` against recorded
launchctl answers (no GUI domain over SSH, a job still present after bootout, bootstrap's
error 5), through the `Context.tool` seam, with a fake clock so that no test sleeps."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from server.service import fatal, launchd
from server.service.base import Context
from server.service.spec import LABEL, ServiceSpec

UID = os.getuid()
GUI, USER = f"gui/{UID}", f"user/{UID}"
NO_DOMAIN = f"Could not find domain for user gui: {UID}"
NO_SERVICE = f'Bad request.\nCould not find service "{LABEL}" in domain for user gui: {UID}'
EIO = "Bootstrap failed: 5: Input/output error\nTry re-running the command as root for richer errors."
PRINT_RUNNING = f"{GUI}/{LABEL} = {{\n\tstate = running\n\tpid = 4242\n}}"
PRINT_WAITING = f"{GUI}/{LABEL} = {{\n\tstate = not running\n\tlast exit code = 0\n}}"


class Launchctl:
    """launchctl as a Mac answers it. `loaded` is whether the job is in launchd; a bootout
    leaves it there for `linger` more `print`s (launchd removes it asynchronously)."""

    def __init__(self, *, gui: bool = True, loaded: bool = False, linger: int = 0,
                 bootstrap_eio: int = 0, bootout_fails: bool = False,
                 print_text: str = PRINT_RUNNING) -> None:
        self.gui, self.loaded, self.linger = gui, loaded, linger
        self.bootstrap_eio, self.bootout_fails = bootstrap_eio, bootout_fails
        self.print_text = print_text
        self.calls: list[str] = []
        self._lingering: int | None = None
        self.where: str | None = None  # the domain bootstrapped into; None: any (preloaded)

    def __call__(self, cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        assert cmd[0] == "launchctl"
        self.calls.append(" ".join(cmd[1:]))
        verb, target = cmd[1], cmd[2]
        if verb == "print" and target.count("/") == 1:  # a domain
            return self._answer(0 if self.gui or not target.startswith("gui/") else 113, NO_DOMAIN)
        if verb == "print":
            if self._lingering is not None:
                if self._lingering == 0:
                    self.loaded, self._lingering = False, None
                else:
                    self._lingering -= 1
            return self._answer(0, self.print_text) if self._here(target) else self._answer(113, NO_SERVICE)
        if verb == "bootout":
            if not self._here(target):
                return self._answer(3, "Boot-out failed: 3: No such process")
            if self.bootout_fails:
                return self._answer(1, "Boot-out failed: 1: Operation not permitted")
            self._lingering = self.linger
            return self._answer(0, "")
        if verb == "bootstrap":
            if self.bootstrap_eio > 0:
                self.bootstrap_eio -= 1
                return self._answer(5, EIO)
            self.loaded, self.where = True, target
            return self._answer(0, "")
        raise AssertionError(cmd)

    def _here(self, target: str) -> bool:
        return self.loaded and (self.where is None or target.startswith(self.where + "/"))

    @staticmethod
    def _answer(rc: int, text: str) -> subprocess.CompletedProcess[str]:
        out, err = (text, "") if rc == 0 else ("", text)
        return subprocess.CompletedProcess([], rc, out, err)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def context(tmp_path: Path, tool: Launchctl, clock: Clock, domain: str | None = None) -> Context:
    return Context(home=tmp_path, tool=tool, sleep=clock.sleep, clock=clock, domain=domain)


def spec(ctx: Context) -> ServiceSpec:
    p = launchd.paths(ctx)
    return ServiceSpec(program=("/bin/mlx-headroom",), serve_args=("--model", "m"),
                       env_file=p.env_file, log_dir=p.log_dir,
                       service_args=tuple(launchd.service_args(p)))


def install(tmp_path: Path, tool: Launchctl, clock: Clock, **kw: str) -> tuple[int, Context]:
    ctx = context(tmp_path, tool, clock, **kw)
    return launchd.install(ctx, spec(ctx)), ctx


def test_the_gui_domain_when_there_is_a_gui_session(tmp_path, capsys):
    tool, clock = Launchctl(gui=True), Clock()
    rc, ctx = install(tmp_path, tool, clock)
    assert rc == 0
    plist = launchd.paths(ctx).config_file
    assert tool.calls == [f"print {GUI}", f"bootout {GUI}/{LABEL}", f"bootstrap {GUI} {plist}"]
    assert f"launchd domain: {GUI} (this user has a GUI login session)" in capsys.readouterr().out


def test_the_user_domain_without_a_gui_session(tmp_path, capsys):
    tool, clock = Launchctl(gui=False), Clock()
    rc, ctx = install(tmp_path, tool, clock)
    assert rc == 0
    assert tool.calls[-1] == f"bootstrap {USER} {launchd.paths(ctx).config_file}"
    assert f"launchd domain: {USER} (no GUI login session" in capsys.readouterr().out


def test_domain_override_is_not_second_guessed(tmp_path, capsys):
    tool, clock = Launchctl(gui=True), Clock()
    rc, _ = install(tmp_path, tool, clock, domain=USER)
    assert rc == 0 and not any(c == f"print {GUI}" for c in tool.calls)
    assert f"launchd domain: {USER} (--domain)" in capsys.readouterr().out


def test_reinstall_waits_for_the_old_job_to_go_then_bootstraps(tmp_path):
    tool, clock = Launchctl(loaded=True, linger=3), Clock()
    rc, ctx = install(tmp_path, tool, clock)
    assert rc == 0
    target = f"{GUI}/{LABEL}"
    assert tool.calls == [f"print {GUI}", f"bootout {target}", *[f"print {target}"] * 4,
                          f"bootstrap {GUI} {launchd.paths(ctx).config_file}"]
    assert clock.sleeps == [launchd.GONE_POLL_S] * 3  # polled, not slept for a fixed time


def test_error_5_is_retried_once_after_waiting(tmp_path, capsys):
    tool, clock = Launchctl(loaded=True, bootstrap_eio=1), Clock()
    rc, _ = install(tmp_path, tool, clock)
    assert rc == 0 and tool.loaded
    assert [c.split()[0] for c in tool.calls].count("bootstrap") == 2
    assert "error 5 (Input/output error)" in capsys.readouterr().out


def test_error_5_twice_fails_with_what_to_run(tmp_path):
    tool, clock = Launchctl(loaded=True, linger=10**6, bootstrap_eio=2), Clock()
    with pytest.raises(RuntimeError) as err:
        install(tmp_path, tool, clock)
    assert [c.split()[0] for c in tool.calls].count("bootstrap") == 2  # one retry, no more
    message = str(err.value)
    assert "status 5" in message and "Input/output error" in message
    assert f"launchctl bootout {GUI}/{LABEL}" in message
    # bounded: each wait gave up after GONE_TIMEOUT_S of fake time
    assert clock.now == pytest.approx(2 * launchd.GONE_TIMEOUT_S, abs=2 * launchd.GONE_POLL_S)


def test_uninstall_keeps_the_files_when_the_job_stays_loaded(tmp_path, capsys):
    tool, clock = Launchctl(), Clock()
    _, ctx = install(tmp_path, tool, clock)
    tool.bootout_fails = True
    p = launchd.paths(ctx)
    assert launchd.uninstall(ctx) == 1
    assert p.config_file.exists() and p.env_file.exists()
    out = capsys.readouterr().out
    assert "Operation not permitted" in out and f"Run `launchctl bootout {GUI}/{LABEL}`" in out


def test_uninstall_and_status_find_the_job_in_the_domain_it_was_installed_in(tmp_path, capsys):
    """Installed over SSH (user/), then uninstalled from a GUI login: the job is booted out
    of user/, not looked for in gui/ while its plist is deleted."""
    tool, clock = Launchctl(gui=False), Clock()
    _, ctx = install(tmp_path, tool, clock)
    tool.gui = True
    capsys.readouterr()
    assert launchd.status(ctx) == 0
    assert f"loaded: yes ({USER}/{LABEL})" in capsys.readouterr().out
    assert launchd.uninstall(ctx) == 0
    assert f"bootout {USER}/{LABEL}" in tool.calls and not tool.loaded
    assert f"launchd domain: {USER} (the job is loaded there)" in capsys.readouterr().out


def test_uninstall_removes_the_files_once_the_job_is_gone(tmp_path):
    tool, clock = Launchctl(), Clock()
    _, ctx = install(tmp_path, tool, clock)
    tool.linger = 2
    p = launchd.paths(ctx)
    assert launchd.uninstall(ctx) == 0
    assert not p.config_file.exists() and not p.env_file.exists()


def test_uninstall_of_a_job_never_loaded_removes_the_files(tmp_path):
    tool, clock = Launchctl(bootstrap_eio=10), Clock()
    with pytest.raises(RuntimeError):
        install(tmp_path, tool, clock)
    ctx = context(tmp_path, tool, clock)
    assert launchd.uninstall(ctx) == 0
    assert not launchd.paths(ctx).config_file.exists()


def test_status_shows_the_last_configuration_error(tmp_path, capsys):
    tool, clock = Launchctl(print_text=PRINT_WAITING), Clock()
    _, ctx = install(tmp_path, tool, clock)
    p = launchd.paths(ctx)
    assert p.log_dir is not None
    fatal.write(p.log_dir / fatal.FILE_NAME, 4, "not loading big: needs 80 GiB, the ceiling is 40 GiB")
    capsys.readouterr()
    assert launchd.status(ctx) == 3
    out = capsys.readouterr().out
    assert "state: not running" in out and "last exit code: 0" in out
    assert "stopped by a configuration error, not restarted (exit 4 at " in out
    assert "needs 80 GiB" in out
    tool.print_text = PRINT_RUNNING  # running again: the record is not news
    assert launchd.status(ctx) == 0 and "configuration error" not in capsys.readouterr().out


def test_install_clears_an_old_record(tmp_path):
    tool, clock = Launchctl(), Clock()
    ctx = context(tmp_path, tool, clock)
    p = launchd.paths(ctx)
    assert p.log_dir is not None
    fatal.write(p.log_dir / fatal.FILE_NAME, 2, "bad flag")
    launchd.install(ctx, spec(ctx))
    assert fatal.read(p.log_dir / fatal.FILE_NAME) is None
