"""A probe wrapper that no probe failure gets through unanswered.

Any exception from the wrapped probe (a syscall, a missing sysctl, a bug) is logged once
when it starts; the last good snapshot stands in for ``grace_s``; after that every read
raises :class:`~memory.errors.ProbeUnavailableError`, so admission stops (nothing is
admitted blind) and the engine answers "memory probe unavailable, retry later" until the
probe answers again. The engine never dies of a probe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import ProbeUnavailableError
from ..snapshot import MemorySnapshot
from .base import Probe

PROBE_GRACE_S = 5.0
PROBE_RETRY_AFTER_S = 5

log = logging.getLogger("mlx_headroom.memory")


class ResilientProbe:
    """Wraps a probe: a fresh reading, or the last good one for ``grace_s``, or
    :class:`ProbeUnavailableError`. Safe to read from several threads."""

    def __init__(
        self,
        probe: Probe,
        *,
        grace_s: float = PROBE_GRACE_S,
        retry_after_s: int = PROBE_RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        self._grace_s = grace_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_good: tuple[MemorySnapshot, float] | None = None
        self._failing_since: float | None = None
        self._unavailable_logged = False

    def read(self) -> MemorySnapshot:
        try:
            snap = self.probe.read()
        except Exception as exc:  # any probe failure: a syscall, a missing key, a bug
            return self._fallback(exc)
        now = self._clock()
        with self._lock:
            self._last_good = (snap, now)
            failing_since, self._failing_since = self._failing_since, None
            self._unavailable_logged = False
        if failing_since is not None:
            log.warning("memory probe recovered after %.1fs", now - failing_since)
        return snap

    def status(self) -> str:
        """``"ok"``, ``"stale"`` (failing; the last good reading stands in) or
        ``"unavailable"``. For /health; does not read the probe."""
        with self._lock:
            if self._failing_since is None:
                return "ok"
            last = self._last_good
        if last is not None and self._clock() - last[1] <= self._grace_s:
            return "stale"
        return "unavailable"

    def _fallback(self, exc: Exception) -> MemorySnapshot:
        now = self._clock()
        with self._lock:
            first = self._failing_since is None
            if first:
                self._failing_since = now
            failing_for = now - (self._failing_since or now)
            last = self._last_good
            usable = last is not None and now - last[1] <= self._grace_s
            log_unavailable = not usable and not self._unavailable_logged
            if log_unavailable:
                self._unavailable_logged = True
        if first:
            log.warning("memory probe failed (%s: %s); the last good reading stands in for "
                        "up to %.0fs", type(exc).__name__, exc, self._grace_s)
        if usable and last is not None:
            return last[0]
        if log_unavailable:
            log.error("memory probe unavailable for %.1fs: refusing new work until it "
                      "answers (%s: %s)", failing_for, type(exc).__name__, exc)
        raise ProbeUnavailableError(
            f"memory probe unavailable: no memory reading for {failing_for:.0f}s "
            f"({type(exc).__name__}: {exc}); new work waits until it answers again",
            failing_for_s=failing_for,
            retry_after_s=self._retry_after_s,
        ) from exc
