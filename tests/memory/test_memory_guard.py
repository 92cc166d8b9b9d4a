from __future__ import annotations

import threading

import pytest
from memtest_helpers import FixedProbe, GiB, snap

from memory import AdmissionQuery, GuardState, MemoryGuard, Outcome, Tier

# 64 GiB machine, usage 10 GiB: balanced static ceiling 58 GiB, aggressive 60 GiB.
PROBE_SNAP = snap(free_bytes=50 * GiB)


def guard(**kwargs: object) -> MemoryGuard:
    return MemoryGuard(FixedProbe(PROBE_SNAP), **kwargs)  # type: ignore[arg-type]


def test_check_admits_and_records() -> None:
    g = guard()
    d = g.check(AdmissionQuery(predicted_bytes=1 * GiB, request_id="a"))
    assert d.outcome is Outcome.ADMIT and d.request_id == "a" and d.at > 0
    assert g.recent_decisions() == [d]
    assert g.counts()[Outcome.ADMIT] == 1 and g.counts()[Outcome.REJECT] == 0


def test_tier_switch_changes_the_decision_at_runtime() -> None:
    g = guard()
    q = AdmissionQuery(predicted_bytes=49 * GiB)  # need 59 GiB
    assert g.check(q).outcome is Outcome.REJECT
    assert g.configure(tier=Tier.AGGRESSIVE) == GuardState(True, Tier.AGGRESSIVE, None)
    assert g.check(q).outcome is Outcome.ADMIT
    assert g.ceiling().binding == "static"


def test_disable_admits_everything() -> None:
    g = guard()
    g.configure(enabled=False)
    d = g.check(AdmissionQuery(predicted_bytes=1000 * GiB))
    assert d.outcome is Outcome.ADMIT and d.reason == "memory guard disabled"
    assert d.limit_bytes == 58 * GiB  # numbers still reported
    g.configure(enabled=True)
    assert g.check(AdmissionQuery(predicted_bytes=1000 * GiB)).outcome is Outcome.REJECT


def test_custom_ceiling_validation_and_switching() -> None:
    g = guard()
    with pytest.raises(ValueError):
        g.configure(tier=Tier.CUSTOM)  # no ceiling
    with pytest.raises(ValueError):
        g.configure(ceiling_bytes=0)
    with pytest.raises(ValueError):
        g.configure(tier=Tier.SAFE, ceiling_bytes=8 * GiB)
    assert g.state() == GuardState(True, Tier.BALANCED, None)  # failures change nothing
    assert g.configure(ceiling_bytes=12 * GiB) == GuardState(True, Tier.CUSTOM, 12 * GiB)
    assert g.ceiling().hard_bytes == 12 * GiB
    assert g.check(AdmissionQuery(predicted_bytes=3 * GiB)).outcome is Outcome.REJECT
    assert g.configure(enabled=False).ceiling_bytes == 12 * GiB  # kept while custom
    assert g.configure(tier=Tier.SAFE) == GuardState(False, Tier.SAFE, None)
    with pytest.raises(ValueError):
        MemoryGuard(FixedProbe(PROBE_SNAP), tier=Tier.CUSTOM)
    assert (
        MemoryGuard(FixedProbe(PROBE_SNAP), tier=Tier.CUSTOM, custom_ceiling_bytes=5 * GiB)
        .ceiling()
        .hard_bytes
        == 5 * GiB
    )


def test_history_is_a_capped_ring() -> None:
    g = guard()
    for i in range(150):
        g.check(AdmissionQuery(predicted_bytes=i))
    recent = g.recent_decisions()
    assert len(recent) == 100
    assert [d.predicted_bytes for d in recent] == list(range(50, 150))
    assert sum(g.counts().values()) == 150
    assert len(guard(history=3).recent_decisions()) == 0


def test_concurrent_checks_and_reconfiguration() -> None:
    g = guard()
    errors: list[BaseException] = []

    def checker() -> None:
        try:
            for _ in range(500):
                d = g.check(AdmissionQuery(predicted_bytes=49 * GiB))
                assert d.outcome in (Outcome.ADMIT, Outcome.REJECT)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def switcher() -> None:
        for i in range(500):
            g.configure(tier=Tier.AGGRESSIVE if i % 2 else Tier.BALANCED)

    threads = [threading.Thread(target=checker) for _ in range(4)]
    threads.append(threading.Thread(target=switcher))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert sum(g.counts().values()) == 2000
    assert len(g.recent_decisions()) == 100


def test_refusals_are_kept_apart_from_the_admits_that_follow() -> None:
    g = guard(history=3)
    reject = g.check(AdmissionQuery(predicted_bytes=1000 * GiB, request_id="big"))
    assert reject.outcome is Outcome.REJECT
    for i in range(5):  # one admit per prefill chunk soon fills the shared history
        g.check(AdmissionQuery(predicted_bytes=1 * GiB, request_id=f"small-{i}"))
    assert reject not in g.recent_decisions()
    assert g.recent_refusals() == [reject]
    assert g.counts()[Outcome.REJECT] == 1
