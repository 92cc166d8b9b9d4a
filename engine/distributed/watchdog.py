"""A deadline on the group: a collective that never returns must not hang the server.

MLX's collectives block in C++ until every rank takes part. The ring backend raises when a
peer's socket closes, but a peer that hangs (or NCCL, which may wait forever) gives no
error at all. So every completed collective is a heartbeat, and a thread checks that one
came within `timeout_s`; when none did, it runs `on_fault` (rank 0 fails its in-flight
requests and turns /health to 503) and, `grace_s` later, ends the process with
`os._exit`, which no blocked thread can delay. The launcher sees a rank exit non-zero and
terminates the others.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("mlx_headroom.distributed")

EXIT_GROUP_FAILED = 4


class GroupFailedError(RuntimeError):
    """The tensor-parallel group cannot go on: a rank died, diverged or stopped answering."""


class Watchdog:
    def __init__(
        self,
        timeout_s: float,
        *,
        on_fault: Callable[[GroupFailedError], None] = lambda exc: None,
        grace_s: float = 2.0,
        exit_code: int = EXIT_GROUP_FAILED,
    ) -> None:
        self.timeout_s = timeout_s
        self.on_fault = on_fault
        self.grace_s = grace_s
        self.exit_code = exit_code
        self._last = time.monotonic()
        self._fired = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-headroom-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    @property
    def fired(self) -> bool:
        return self._fired.is_set()

    def fail(self, exc: GroupFailedError) -> None:
        """Fail now (a collective raised, the ranks diverged): the same ending as a timeout."""
        if self._fired.is_set():
            return
        self._fired.set()
        print(f"mlx-headroom: tensor-parallel group failed: {exc}; exiting with status "
              f"{self.exit_code}", file=sys.stderr, flush=True)
        if "no collective completed" in str(exc):
            faulthandler.dump_traceback(all_threads=True)  # where each thread waits
        try:
            self.on_fault(exc)
        except BaseException:  # the exit below must happen whatever the handler does
            log.exception("the group-failure handler failed")
        threading.Thread(target=self._exit_later, name="mlx-headroom-exit", daemon=True).start()

    def _exit_later(self) -> None:
        time.sleep(self.grace_s)  # let the failed requests' answers reach their clients
        os._exit(self.exit_code)

    def _run(self) -> None:
        while not self._fired.is_set():
            time.sleep(min(0.25, self.timeout_s / 4))
            quiet = time.monotonic() - self._last
            if quiet > self.timeout_s:
                self.fail(GroupFailedError(
                    f"no collective completed for {quiet:.1f}s (deadline {self.timeout_s:.0f}s): "
                    "a rank stopped answering"))
