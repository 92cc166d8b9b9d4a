"""uvicorn's server as `serve` runs it, kept apart from the command line so that the
command line starts without importing uvicorn (a `serve` on jemalloc re-executes itself
before it needs it, and `service` and `doctor` never do)."""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


class HTTPServer(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, so the process would
    die of the signal; a service that drained cleanly should exit 0 instead. When the
    engine dies, `fail` stops it with a non-zero code, so that launchd's KeepAlive or
    systemd's Restart=on-failure starts a fresh process."""

    exit_code = 0
    port_in_use = False  # the bind failed with EADDRINUSE: transient, unlike uvicorn's exit 3

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn exits 3 both when the app cannot start and when the port cannot be bound;
        the bind's SystemExit is raised while handling its OSError, which tells them apart."""
        try:
            await super().startup(sockets)
        except SystemExit as exc:
            cause = exc.__context__
            self.port_in_use = isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE
            raise

    def fail(self, exc: BaseException, exit_code: int) -> None:
        print(f"mlx-headroom: the engine died ({type(exc).__name__}: {exc}); exiting with "
              f"status {exit_code}", file=sys.stderr)
        self.exit_code = exit_code
        self.should_exit = True

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def port_holder(port: int) -> str | None:
    """Who holds TCP `port`, as "pid N (name)", where psutil can tell; None where it cannot
    (another user's process, or nothing left but connections in TIME_WAIT). macOS lists the
    system's connections only to root, so there each process this user may inspect is asked."""
    import psutil

    try:
        conns = [(c.pid, c.laddr) for c in psutil.net_connections(kind="tcp")]
    except psutil.AccessDenied:
        conns = []
        for proc in psutil.process_iter():
            try:
                own = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6
                conns += [(proc.pid, c.laddr) for c in own(kind="tcp")]
            except psutil.Error:
                continue
    pids = sorted({pid for pid, laddr in conns if pid and laddr and laddr.port == port})
    return ", ".join(_describe(pid) for pid in pids) or None


def _describe(pid: int) -> str:
    import psutil

    try:
        return f"pid {pid} ({psutil.Process(pid).name()})"
    except psutil.Error:
        return f"pid {pid}"
