"""uvicorn's server as `serve` runs it, kept apart from the command line so that the
command line starts without importing uvicorn (a `serve` on jemalloc re-executes itself
before it needs it, and `service` and `doctor` never do)."""

from __future__ import annotations

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
