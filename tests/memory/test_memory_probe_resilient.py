"""ResilientProbe: a failing probe is answered by the last good reading for a while, then
refused (never admitted blind); the guard passes the refusal on, unless it is disabled."""

from __future__ import annotations

import pytest
from memtest_helpers import FixedProbe, GiB, snap

from memory import AdmissionQuery, MemoryGuard, Outcome, ProbeUnavailableError, ResilientProbe

GOOD = snap(free_bytes=50 * GiB)


class FlakyProbe(FixedProbe):
    def __init__(self) -> None:
        super().__init__(GOOD)
        self.error: Exception | None = None

    def read(self):  # type: ignore[no-untyped-def]
        if self.error is not None:
            raise self.error
        return super().read()


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_last_good_reading_stands_in_then_the_probe_is_unavailable() -> None:
    flaky, clock = FlakyProbe(), Clock()
    probe = ResilientProbe(flaky, grace_s=5.0, clock=clock)
    g = MemoryGuard(probe)
    q = AdmissionQuery(predicted_bytes=1 * GiB)
    assert g.check(q).outcome is Outcome.ADMIT and g.probe_status() == "ok"
    flaky.error = OSError("host_statistics64 failed: -307")
    clock.now = 4.0
    assert g.check(q).outcome is Outcome.ADMIT  # the reading of t=0 stands in
    assert g.snapshot() == GOOD and g.probe_status() == "stale"
    clock.now = 6.0
    with pytest.raises(ProbeUnavailableError) as info:
        probe.read()
    assert info.value.retry_after_s > 0 and "memory probe unavailable" in str(info.value)
    assert info.value.failing_for_s == 2.0
    # The guard never admits blind and never refuses for good: the request waits, re-reading.
    waiting = g.check(q)
    assert (waiting.outcome, waiting.code) == (Outcome.WAIT, "memory_probe_failed")
    assert "memory probe unavailable" in waiting.reason
    with pytest.raises(ProbeUnavailableError):
        g.ceiling()
    assert g.probe_status() == "unavailable"
    flaky.error = None
    assert g.check(q).outcome is Outcome.ADMIT and g.probe_status() == "ok"


def test_a_probe_that_never_answered_is_unavailable_at_once() -> None:
    flaky = FlakyProbe()
    flaky.error = KeyError("max_recommended_working_set_size")  # any exception, not just OSError
    g = MemoryGuard(ResilientProbe(flaky))
    assert g.check(AdmissionQuery(predicted_bytes=1)).outcome is Outcome.WAIT
    g.configure(enabled=False)  # the user turned admission control off: nothing to protect
    d = g.check(AdmissionQuery(predicted_bytes=1))
    assert d.outcome is Outcome.ADMIT and d.reason.startswith("memory guard disabled")
