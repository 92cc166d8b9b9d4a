"""Shared fixtures: the tiny model, and real server processes on free loopback ports."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests import forkserver

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_run(count: int = 8) -> int:
    """The first of `count` consecutive free ports, below Linux's ephemeral range (32768 up),
    for a tensor-parallel group whose ranks listen on the port and the ones after it: a
    port `free_port` gave is in that range, where the suite's own client connections take
    the next ports at any moment (a rank then failed with "[ring] Couldn't bind socket
    (error: 98)")."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32768 - count)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no run of {count} free ports below 32768")


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll a condition on a server until it holds (the server has no push channel)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


class PortTaken(RuntimeError):
    """The server could not bind its port: something else took it first."""


@dataclass
class ServerProcess:
    """`mlx-headroom serve` in a child process; `url` is ready once started."""

    model: Path
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | forkserver.ForkedServer | None = None
    log_path: Path | None = None
    # What python runs: the CLI module, or `-c CODE` that patches something first.
    python_args: list[str] = field(default_factory=lambda: ["-m", "server.cli"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # A generous readiness bound: the poll returns as soon as /health answers; only a start
    # that never comes waits it out (a loaded 2-core machine took over 60 s for one).
    def start(self, log_dir: Path, timeout: float = 240.0) -> ServerProcess:
        for _ in range(3):
            try:
                return self._start(log_dir, timeout)
            except PortTaken:
                # free_port's port was taken by another process (a parallel worker's
                # server) between the probe and the bind: try another one.
                self.port = free_port()
        return self._start(log_dir, timeout)

    def _start(self, log_dir: Path, timeout: float) -> ServerProcess:
        env = {**os.environ, "MLX_HEADROOM_LOG_LEVEL": "info", **self.env}
        self.log_path = log_dir / f"server-{self.port}.log"
        argv = ["serve", "--model", str(self.model), "--port", str(self.port),
                "--served-model-name", MODEL, *self.args]
        if forkserver.forkable(self.python_args, self.env, self.args):
            self.proc = forkserver.start(argv, env, ROOT, self.log_path)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, *self.python_args, *argv], cwd=ROOT, env=env,
                stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.log().lower():
                    raise PortTaken(self.port)
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # polling for readiness, not synchronising a test
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One default server shared by tests that do not change its settings."""
    proc = ServerProcess(tiny_model_path, env={"MLX_HEADROOM_MAX_QUEUE": "64"}).start(
        tmp_path_factory.mktemp("logs")
    )
    yield proc
    proc.stop()


@pytest.fixture
def start_server(tiny_model_path: Path, tmp_path: Path) -> Iterator[object]:
    """Start servers with custom settings; they are stopped after the test."""
    started: list[ServerProcess] = []

    def start(env: dict[str, str] | None = None, args: list[str] | None = None) -> ServerProcess:
        proc = ServerProcess(tiny_model_path, env=env or {}, args=args or []).start(tmp_path)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


ALLOCATOR = ["--memory-probe", "allocator"]
"""Usage is MLX's own allocator count, exact: a custom ceiling a little above it simulates a
small machine."""
SMALL_MACHINE_ENV = {"MLX_HEADROOM_PREFIX_CACHE_BYTES": "0"}
"""The shared small-machine servers keep no prefix: what one test left cached would be
memory the guard could free for the next one, where a fresh server has none."""


def reset_guard(proc: ServerProcess) -> ServerProcess:
    """Bring a shared server back to how it started: nothing in flight, nothing committed,
    the guard on at its default tier (which drops a custom ceiling, and with it MLX's cache
    limit)."""

    def settled() -> bool:
        m = httpx.get(proc.url + "/v1/memory", timeout=10).json()
        q = m["queue"]
        return q["waiting"] + q["prefilling"] + q["running"] == 0 and m["committed_bytes"] == 0

    wait_until(settled)
    r = httpx.put(proc.url + "/v1/memory-guard", json={"enabled": True, "tier": "balanced"})
    assert r.json() == {"enabled": True, "tier": "balanced", "ceiling_bytes": None}, r.text
    return proc


@pytest.fixture(scope="session")
def _small_machine(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    env = {**SMALL_MACHINE_ENV, "MLX_HEADROOM_MEMORY_WAIT_TIMEOUT_S": "120"}
    proc = ServerProcess(tiny_model_path, env=env, args=ALLOCATOR).start(
        tmp_path_factory.mktemp("small-machine"))
    yield proc
    proc.stop()


@pytest.fixture
def small_machine(_small_machine: ServerProcess) -> ServerProcess:
    """One `--memory-probe allocator` server shared by the tests that set a custom ceiling
    on it, reset before each; a request that has to wait for memory waits up to 120 s."""
    return reset_guard(_small_machine)


@pytest.fixture(scope="session")
def _small_machine_short_wait(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
                              ) -> Iterator[ServerProcess]:
    env = {**SMALL_MACHINE_ENV, "MLX_HEADROOM_MEMORY_WAIT_TIMEOUT_S": "0.3"}
    proc = ServerProcess(tiny_model_path, env=env, args=ALLOCATOR).start(
        tmp_path_factory.mktemp("small-machine-short-wait"))
    yield proc
    proc.stop()


@pytest.fixture
def small_machine_short_wait(_small_machine_short_wait: ServerProcess) -> ServerProcess:
    """As `small_machine`, but a request that has to wait for memory gives up after 0.3 s."""
    return reset_guard(_small_machine_short_wait)


KEYS = ("api-key-123", "admin-key-456")
"""The API key and the admin key of `keyed_server`."""


@pytest.fixture(scope="session")
def keyed_server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[ServerProcess]:
    """One server that needs the API key for data and the admin key for admin routes."""
    api, admin = KEYS
    proc = ServerProcess(tiny_model_path, env={"MLX_HEADROOM_API_KEY": api,
                                               "MLX_HEADROOM_ADMIN_KEY": admin}).start(
        tmp_path_factory.mktemp("keyed"))
    yield proc
    proc.stop()


MODEL = "mlx-headroom/tiny-chat"
