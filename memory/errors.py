"""Errors of the memory package.

    ProbeError (OSError)        one reading failed (a syscall, a missing sysctl); the probe
                                or the guard decides what to answer instead
    ProbeUnavailableError       the guard has no reading it may trust: the probe has failed
                                for longer than the grace period. Admission stops (never
                                admits blind) until the probe answers again; it is
                                temporary, so callers say "retry later", not "too big".
"""

from __future__ import annotations


class ProbeError(OSError):
    """A probe could not read the machine."""


class ProbeUnavailableError(Exception):
    def __init__(self, message: str, *, failing_for_s: float, retry_after_s: int) -> None:
        super().__init__(message)
        self.failing_for_s = failing_for_s
        self.retry_after_s = retry_after_s
