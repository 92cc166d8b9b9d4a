"""Test servers forked from a process that has already imported the server.

A `mlx-headroom serve` process spends about 4 s of CPU before its first log line, importing
FastAPI, the engine, mlx-lm and transformers; the suite starts about ninety servers, on two
cores. Each pytest worker therefore keeps one multiprocessing fork server that imported
those modules once, and a test's server is a fork of it that runs `server.cli.main` with
the test's arguments, environment, working directory and log file: the same code from
`main` on, a process of its own (pid, signals, exit status), bound to its own port. `run`
does the same for a command that ends (a refused start, `doctor`), with its stdout and
stderr apart.

The fork server starts as `serve` re-executes itself (`server.malloc`): jemalloc and OpenBLAS
preloaded where the machine has them, so a forked server runs on the allocator a real one
does. What a fork cannot reproduce takes a real exec instead (`forkable` says which): another
interpreter command, an allocator or preload of the test's own, an env file (its `MALLOC`
re-executes), and any platform but Linux (macOS does not allow fork after its frameworks
load). `MLX_HEADROOM_TEST_FORK=0` turns forking off.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from multiprocessing.context import ForkServerContext
from pathlib import Path

PRELOAD = [
    "server.cli", "server.app", "server.engine_config", "server.model_fit", "uvicorn",
    "mlx_lm", "mlx_lm.tokenizer_utils", "mlx_lm.models.llama", "mlx_lm.models.cache", "transformers",
    "tests.forkserver",
]
_OWN_PROCESS_ENV = ("LD_PRELOAD", "MLX_HEADROOM_MALLOC", "MLX_HEADROOM_OPENBLAS", "HF_", "TRANSFORMERS_")
_OWN_PROCESS_ARGS = ("--malloc", "--env-file")
_context: ForkServerContext | None = None


def forkable(python_args: list[str], env: dict[str, str], args: list[str]) -> bool:
    """Whether a server with these settings may be forked rather than executed."""
    if os.environ.get("MLX_HEADROOM_TEST_FORK", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if python_args != ["-m", "server.cli"]:
        return False
    if any(key.startswith(_OWN_PROCESS_ENV) for key in env):
        return False
    return not any(a.startswith(_OWN_PROCESS_ARGS) for a in args)


class ForkedServer:
    """The parts of `subprocess.Popen` the tests use, over a forked server process."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["serve"], timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(argv: list[str], env: dict[str, str], cwd: Path, log_path: Path,
          err_path: Path | None = None) -> ForkedServer:
    """`mlx-headroom <argv>` as a fork, its stdout in `log_path` and its stderr there too, or
    in `err_path`."""
    process = _fork_server().Process(
        target=_serve, args=(argv, env, str(cwd), str(log_path), str(err_path or log_path)),
        daemon=True)
    process.start()
    return ForkedServer(process)


def run(argv: list[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`mlx-headroom <argv>` to its end in this environment, as `subprocess.run(...,
    capture_output=True, text=True)` gives it; a real exec where a fork cannot stand in."""
    if not forkable(["-m", "server.cli"], {}, argv):
        return subprocess.run([sys.executable, "-m", "server.cli", *argv], cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        process = start(argv, dict(os.environ), cwd, out, err)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def _fork_server() -> ForkServerContext:
    global _context
    if _context is None:
        from server.malloc import find_jemalloc, with_openblas

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        # The fork server is executed with this process's environment, at its first use:
        # give it the preload `serve` gives itself, then put ours back.
        saved = dict(os.environ)
        preload = " ".join(p for p in (find_jemalloc(), os.environ.get("LD_PRELOAD")) if p)
        os.environ.update(with_openblas({**os.environ, "LD_PRELOAD": preload}) or {"LD_PRELOAD": preload})
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # as `main` sets it before any import
        try:
            probe = context.Process(target=_ready, daemon=True)
            probe.start()
            probe.join()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _context = context
    return _context


def _ready() -> None:
    """A first child, so that the fork server is running before the environment is restored."""


def _serve(argv: list[str], env: dict[str, str], cwd: str, log_path: str, err_path: str) -> None:
    from server.cli import main

    for fd, path in ((1, log_path), (2, err_path)):
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        os.dup2(log, fd)
        os.close(log)
    os.chdir(cwd)
    preload = os.environ.get("LD_PRELOAD", "")  # what this process really runs on
    os.environ.clear()
    os.environ.update({**env, "LD_PRELOAD": preload, "MLX_HEADROOM_MALLOC_CHOSEN": "1"})
    sys.argv = [sys.argv[0], *argv]
    try:
        code = main(argv)
    finally:
        # multiprocessing ends its children with os._exit: run what a normal exit would
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)
