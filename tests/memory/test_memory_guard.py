from __future__ import annotations

import dataclasses
import threading

import pytest
from memtest_helpers import FixedProbe, GiB, MiB, snap

from memory import (
    AdmissionQuery,
    GuardState,
    MemoryGuard,
    MemorySnapshot,
    Outcome,
    Tier,
    cache_limit_bytes,
)

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
    q = AdmissionQuery(predicted_bytes=49 * GiB, baseline_bytes=10 * GiB)  # need 59 GiB
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
    assert g.check(AdmissionQuery(predicted_bytes=3 * GiB, baseline_bytes=10 * GiB)).outcome is Outcome.REJECT
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
                d = g.check(AdmissionQuery(predicted_bytes=49 * GiB, baseline_bytes=10 * GiB))
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
# ---- unknown is not "no": probe failures and stale readings ------------------------------

class FailingProbe:
    """Raises for the first `failures` reads, then returns `snapshot`."""

    def __init__(self, snapshot: MemorySnapshot, failures: int) -> None:
        self.snapshot = snapshot
        self.failures = failures
        self.reads = 0

    def read(self) -> MemorySnapshot:
        self.reads += 1
        if self.reads <= self.failures:
            raise OSError("NVML_ERROR_UNKNOWN")
        return self.snapshot


NEVER_FITS = AdmissionQuery(predicted_bytes=1000 * GiB, baseline_bytes=10 * GiB)
FITS = AdmissionQuery(predicted_bytes=1 * GiB, baseline_bytes=10 * GiB)


@pytest.mark.parametrize("query", [FITS, NEVER_FITS], ids=["fits", "never fits"])
def test_a_failed_probe_waits_and_never_says_do_not_retry(query: AdmissionQuery) -> None:
    probe = FailingProbe(PROBE_SNAP, failures=10)
    g = MemoryGuard(probe)  # type: ignore[arg-type]
    d = g.check(query)
    assert d.outcome is Outcome.WAIT
    assert d.code == "memory_probe_failed"
    assert "NVML_ERROR_UNKNOWN" in d.reason and "reads again" in d.reason
    assert probe.reads == 2  # read once more before giving that answer
    assert cache_limit_bytes(d) is None  # and it says nothing about the room


def test_a_probe_that_fails_once_is_read_again() -> None:
    g = MemoryGuard(FailingProbe(PROBE_SNAP, failures=1))  # type: ignore[arg-type]
    assert g.check(NEVER_FITS).outcome is Outcome.REJECT  # a real reading: final
    g2 = MemoryGuard(FailingProbe(PROBE_SNAP, failures=1))  # type: ignore[arg-type]
    assert g2.check(FITS).outcome is Outcome.ADMIT


def test_a_stale_reading_waits_and_never_says_do_not_retry() -> None:
    now = [1000.0]
    old = dataclasses.replace(PROBE_SNAP, taken_at=990.0)
    probe = FixedProbe(old)
    g = MemoryGuard(probe, max_reading_age_s=2.0, clock=lambda: now[0])  # type: ignore[arg-type]
    d = g.check(NEVER_FITS)
    assert (d.outcome, d.code) == (Outcome.WAIT, "memory_reading_stale")
    assert "10.0s old" in d.reason and probe.reads == 2
    probe.snapshot = dataclasses.replace(PROBE_SNAP, taken_at=999.5)  # fresh again
    assert g.check(NEVER_FITS).outcome is Outcome.REJECT
    assert g.check(FITS).outcome is Outcome.ADMIT


def test_disabled_guard_admits_even_without_a_reading() -> None:
    g = MemoryGuard(FailingProbe(PROBE_SNAP, failures=10), enabled=False)  # type: ignore[arg-type]
    assert g.check(NEVER_FITS).outcome is Outcome.ADMIT


# ---- hand back, then read again ----------------------------------------------------------

class HandBackProbe:
    """A process whose footprint holds `cache` of MLX cache and `pool` untracked on top of
    10 GiB live, on a 16 GiB custom ceiling; `hand_back` returns both."""

    def __init__(self, cache: int, pool: int) -> None:
        self.cache, self.pool, self.hand_backs = cache, pool, 0

    def read(self) -> MemorySnapshot:
        return snap(footprint_bytes=10 * GiB + self.cache + self.pool,
                    allocator_active_bytes=10 * GiB, allocator_cache_bytes=self.cache)

    def hand_back(self) -> None:
        self.hand_backs += 1
        self.cache = self.pool = 0


def custom_guard(probe: HandBackProbe, **kwargs: object) -> MemoryGuard:
    return MemoryGuard(probe, tier=Tier.CUSTOM, custom_ceiling_bytes=16 * GiB, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cache", "pool"), [(4 * GiB, 0), (0, 4 * GiB), (2 * GiB, 2 * GiB)])
def test_what_mlx_holds_unused_is_handed_back_before_a_wait_stands(cache: int, pool: int) -> None:
    p = HandBackProbe(cache, pool)
    g = custom_guard(p)
    q = AdmissionQuery(predicted_bytes=3 * GiB, releasable_bytes=1 * GiB, baseline_bytes=10 * GiB)
    assert g.check(q).outcome is Outcome.WAIT  # no reclaim offered: counts what is there
    d = g.check(q, reclaim=p.hand_back)
    assert d.outcome is Outcome.ADMIT and p.hand_backs == 1 and g.hand_backs == 1
    assert d.usage_bytes == 10 * GiB


def test_no_hand_back_when_it_cannot_change_the_answer() -> None:
    p = HandBackProbe(cache=512 * MiB, pool=0)
    g = custom_guard(p)
    # 1.5 GiB over, of which the cache could return only 0.5 GiB
    short = AdmissionQuery(predicted_bytes=7 * GiB, solo_bytes=5 * GiB, baseline_bytes=10 * GiB)
    assert g.check(short, reclaim=p.hand_back).outcome is Outcome.WAIT
    never = AdmissionQuery(predicted_bytes=7 * GiB, baseline_bytes=10 * GiB)
    assert g.check(never, reclaim=p.hand_back).outcome is Outcome.REJECT  # final without reading
    assert g.check(FITS, reclaim=p.hand_back).outcome is Outcome.ADMIT
    assert p.hand_backs == 0


def test_an_evict_tries_the_cache_before_the_prefix_cache() -> None:
    p = HandBackProbe(cache=2 * GiB, pool=0)
    g = custom_guard(p)
    q = AdmissionQuery(predicted_bytes=5 * GiB, evictable_bytes=4 * GiB, baseline_bytes=10 * GiB)
    d = g.check(q, reclaim=p.hand_back)
    assert d.outcome is Outcome.ADMIT and p.hand_backs == 1


def test_untracked_growth_is_handed_back_now_and_then_even_when_it_fits() -> None:
    now = [0.0]
    p = HandBackProbe(cache=0, pool=1 * GiB)
    g = custom_guard(p, clock=lambda: now[0])
    small = AdmissionQuery(predicted_bytes=0)
    assert g.check(small, reclaim=p.hand_back).outcome is Outcome.ADMIT
    assert p.hand_backs == 1  # 1 GiB untracked, over the 256 MiB margin
    p.pool = 1 * GiB
    now[0] = 0.5
    g.check(small, reclaim=p.hand_back)
    assert p.hand_backs == 1  # at most once a second
    now[0] = 1.5
    g.check(small, reclaim=p.hand_back)
    assert p.hand_backs == 2
    p.pool = 100 * MiB  # under the margin: left alone
    now[0] = 5.0
    g.check(small, reclaim=p.hand_back)
    assert p.hand_backs == 2


def test_the_cache_limit_is_the_room_the_decision_leaves() -> None:
    p = HandBackProbe(cache=1 * GiB, pool=0)
    g = custom_guard(p)
    admit = g.check(AdmissionQuery(predicted_bytes=2 * GiB, committed_bytes=1 * GiB))
    # 16 GiB − (10 live + 1 committed + 2 this step); the cache itself may use the rest
    assert cache_limit_bytes(admit) == 3 * GiB
    wait = g.check(AdmissionQuery(predicted_bytes=8 * GiB, committed_bytes=1 * GiB,
                                  baseline_bytes=1 * GiB))
    assert wait.outcome is Outcome.WAIT and cache_limit_bytes(wait) == 5 * GiB
    assert cache_limit_bytes(g.check(NEVER_FITS)) is None
    g.configure(enabled=False)
    assert cache_limit_bytes(g.check(FITS)) is None


def test_memory_the_pool_returns_late_lowers_what_counts_as_untracked_for_good() -> None:
    """CUDA's pool may return a hand-back's buffers only at a later synchronize: the
    reading right after still shows them. A later, lower reading is the real floor, so the
    pool's next growth is seen as growth."""
    now = [0.0]
    p = HandBackProbe(cache=0, pool=1 * GiB)

    def late_hand_back() -> None:
        p.hand_backs += 1  # nothing comes back yet

    g = custom_guard(p, clock=lambda: now[0])
    g.check(AdmissionQuery(predicted_bytes=0), reclaim=late_hand_back)
    assert g.untracked_excess_bytes(p.read()) == 0  # 1 GiB left: taken as the floor
    p.pool = 0  # returned at the next sync
    g.check(AdmissionQuery(predicted_bytes=0))
    p.pool = 1 * GiB  # the pool grows again
    assert g.untracked_excess_bytes(p.read()) == 1 * GiB
    now[0] = 2.0
    g.check(AdmissionQuery(predicted_bytes=0), reclaim=p.hand_back)
    assert p.hand_backs == 2
