"""Shared fixtures: the tiny model, and real server processes on free loopback ports."""

from __future__ import annotations

import os
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

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


@dataclass
class ServerProcess:
    """`mlx-headroom serve` in a child process; `url` is ready once started."""

    model: Path
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    # What python runs: the CLI module, or `-c CODE` that patches something first.
    python_args: list[str] = field(default_factory=lambda: ["-m", "server.cli"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path, timeout: float = 60.0) -> ServerProcess:
        env = {**os.environ, "MLX_HEADROOM_LOG_LEVEL": "info", **self.env}
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, *self.python_args, "serve", "--model", str(self.model),
               "--port", str(self.port), "--served-model-name", MODEL, *self.args]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
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


MODEL = "mlx-headroom/tiny-chat"
