from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from memtest_helpers import GiB, MiB, snap

from memory import AdmissionQuery, Ceiling, Outcome, Tier, compute_ceiling, decide

# Usage 11 GiB: the footprint as the device counts it, MLX's 1 GiB cache included (the
# guard hands the cache back before a WAIT stands; decide itself counts what is there).
# Balanced, dynamic binds at 12 GiB: 11 footprint + 1 free + 0 inactive + 0 active. The
# fixed ceiling (what could ever be had) is the 16 GiB device.
SNAP = snap(
    footprint_bytes=11 * GiB,
    allocator_active_bytes=10 * GiB,
    allocator_cache_bytes=1 * GiB,
    free_bytes=1 * GiB,
    inactive_bytes=0,
    active_bytes=0,
    device_cap_bytes=16 * GiB,
)
CEIL = compute_ceiling(SNAP, Tier.BALANCED)
WEIGHTS = 10 * GiB

# (name, query, outcome, bytes_to_free, code)
TABLE = [
    ("fits", AdmissionQuery(predicted_bytes=512 * MiB), Outcome.ADMIT, 0, ""),
    ("fits exactly", AdmissionQuery(predicted_bytes=1 * GiB), Outcome.ADMIT, 0, ""),
    (
        "committed pushes over, evict",
        AdmissionQuery(predicted_bytes=1 * GiB, committed_bytes=1 * GiB, evictable_bytes=4 * GiB),
        Outcome.EVICT,
        1 * GiB,
        "",
    ),
    (
        "evict exactly all",
        AdmissionQuery(predicted_bytes=2 * GiB, evictable_bytes=1 * GiB),
        Outcome.EVICT,
        1 * GiB,
        "",
    ),
    (
        "wait for in-flight",
        AdmissionQuery(predicted_bytes=3 * GiB, evictable_bytes=512 * MiB, releasable_bytes=3 * GiB,
                       baseline_bytes=WEIGHTS),
        Outcome.WAIT,
        0,
        "waiting_for_memory",
    ),
    (
        # The dynamic ceiling is low (memory held elsewhere, or not yet handed back), and
        # nothing in flight would release enough: it still fits the 16 GiB device alone.
        "wait: fits alone, even when in-flight requests would not release enough",
        AdmissionQuery(predicted_bytes=4 * GiB, evictable_bytes=512 * MiB, releasable_bytes=1 * GiB,
                       solo_bytes=5 * GiB, baseline_bytes=WEIGHTS),
        Outcome.WAIT,
        0,
        "waiting_for_memory",
    ),
    (
        "reject: does not fit even alone",
        AdmissionQuery(predicted_bytes=4 * GiB, evictable_bytes=512 * MiB, releasable_bytes=1 * GiB,
                       solo_bytes=7 * GiB, baseline_bytes=WEIGHTS),
        Outcome.REJECT,
        0,
        "prefill_memory_exceeded",
    ),
    (
        "reject: prompt alone exceeds ceiling",
        AdmissionQuery(predicted_bytes=17 * GiB, releasable_bytes=1 * GiB),
        Outcome.REJECT,
        0,
        "prompt_exceeds_memory_ceiling",
    ),
]


@pytest.mark.parametrize(
    ("query", "outcome", "to_free", "code"), [t[1:] for t in TABLE], ids=[t[0] for t in TABLE]
)
def test_decision_table(query: AdmissionQuery, outcome: Outcome, to_free: int, code: str) -> None:
    assert (CEIL.binding, CEIL.hard_bytes) == ("dynamic", 12 * GiB)
    assert (CEIL.fixed_binding, CEIL.fixed_bytes) == ("device", 16 * GiB)
    d = decide(SNAP, CEIL, query)
    assert d.outcome is outcome
    assert d.bytes_to_free == to_free
    assert d.code == code
    assert d.usage_bytes == 11 * GiB
    if outcome is Outcome.REJECT:
        # A final refusal is stated in final numbers: alone, against the fixed ceiling.
        assert (d.needed_bytes, d.limit_bytes, d.binding) == (query.alone_bytes, 16 * GiB, "device")
    else:
        assert d.needed_bytes == 11 * GiB + query.committed_bytes + query.predicted_bytes
        assert (d.limit_bytes, d.binding) == (12 * GiB, "dynamic")
    assert d.predicted_bytes == query.predicted_bytes
    assert d.reason.startswith(outcome.name + ":")
    assert "dynamic ceiling 12.0 GiB" in d.reason
    assert "device 16.0 GiB" in d.reason
    assert "11.0 GiB in use" in d.reason


def test_reject_reason_says_what_to_do() -> None:
    d = decide(
        SNAP,
        CEIL,
        AdmissionQuery(
            predicted_bytes=4 * GiB,
            committed_bytes=512 * MiB,
            evictable_bytes=512 * MiB,
            releasable_bytes=1 * GiB,
            request_id="req-1",
            solo_bytes=7 * GiB,
            baseline_bytes=WEIGHTS,
        ),
    )
    assert d.outcome is Outcome.REJECT
    assert d.request_id == "req-1"
    assert d.at == 0.0  # decide is pure; MemoryGuard stamps the time
    for part in (
        "needs 4.0 GiB on top of 11.0 GiB in use",
        "(11.5 GiB with 512.0 MiB committed)",
        "Even alone on an idle server it would need 7.0 GiB on top of 10.0 GiB",
        "1.0 GiB more than the device ceiling of 16.0 GiB",
        "shorten the prompt",
        "lower max_tokens",
        "tier 'aggressive'",
    ):
        assert part in d.reason, (part, d.reason)


def test_evict_and_wait_reasons() -> None:
    e = decide(SNAP, CEIL, AdmissionQuery(predicted_bytes=2 * GiB, evictable_bytes=2 * GiB))
    assert "evict 1.0 GiB of prefix cache (of 2.0 GiB evictable)" in e.reason
    w = decide(SNAP, CEIL, AdmissionQuery(predicted_bytes=3 * GiB, releasable_bytes=3 * GiB))
    assert "hold 3.0 GiB" in w.reason and "waits for memory" in w.reason
    assert "alone on an idle server it needs 3.0 GiB of the device ceiling of 16.0 GiB" in w.reason


def test_custom_ceiling_reason() -> None:
    c = compute_ceiling(SNAP, Tier.CUSTOM, custom_bytes=11 * GiB)
    d = decide(SNAP, c, AdmissionQuery(predicted_bytes=2 * GiB, baseline_bytes=WEIGHTS))
    assert d.outcome is Outcome.REJECT and "custom ceiling of 11.0 GiB" in d.reason
    assert "raise the custom ceiling" in d.reason


def test_the_h200_after_burst_reading_waits_instead_of_refusing_for_good() -> None:
    """Measured on the H200 after 64 concurrent requests: the device had 5.5 GB free, so
    the dynamic ceiling fell to 23.8 GB, and a 60k-token prompt (8.1 GiB) got a 507 that
    said never retry, although it fits the card alone. It must wait instead."""
    total = 143_771 * MiB
    after_burst = snap(platform="cuda", total_bytes=total, footprint_bytes=138_000 * MiB,
                       allocator_active_bytes=18_000 * MiB, allocator_cache_bytes=200 * MiB,
                       free_bytes=5_500 * MiB, inactive_bytes=0, active_bytes=0,
                       device_cap_bytes=total)
    ceiling = compute_ceiling(after_burst, Tier.BALANCED)
    q = AdmissionQuery(predicted_bytes=int(8.1 * GiB), solo_bytes=int(8.1 * GiB),
                       baseline_bytes=16 * GiB)
    d = decide(after_burst, ceiling, q)
    assert d.outcome is Outcome.WAIT and d.code == "waiting_for_memory"


def test_negative_query_rejected() -> None:
    with pytest.raises(ValueError):
        AdmissionQuery(predicted_bytes=-1)


sizes = st.integers(min_value=0, max_value=64 * GiB)


@given(
    footprint=sizes,
    cache=sizes,
    hard=st.integers(min_value=0, max_value=128 * GiB),
    fixed_extra=st.integers(min_value=0, max_value=64 * GiB),
    predicted=sizes,
    committed=sizes,
    evictable=sizes,
    releasable=sizes,
    solo=st.one_of(st.none(), sizes),
    baseline=sizes,
)
def test_decide_properties(
    footprint: int,
    cache: int,
    hard: int,
    fixed_extra: int,
    predicted: int,
    committed: int,
    evictable: int,
    releasable: int,
    solo: int | None,
    baseline: int,
) -> None:
    s = snap(footprint_bytes=footprint, allocator_cache_bytes=min(cache, footprint))
    fixed = hard + fixed_extra  # the dynamic ceiling is never above the fixed one
    ceiling = Ceiling(hard, "dynamic", {"static": fixed, "dynamic": hard}, Tier.BALANCED)
    q = AdmissionQuery(predicted, committed, evictable, releasable,
                       solo_bytes=solo, baseline_bytes=baseline)
    d = decide(s, ceiling, q)
    need = footprint + committed + predicted
    alone = baseline + (predicted if solo is None else solo)
    if need > hard:
        assert d.outcome is not Outcome.ADMIT
    else:
        assert d.outcome is Outcome.ADMIT and d.needed_bytes == need
    if d.outcome is Outcome.EVICT:
        assert 0 < d.bytes_to_free <= evictable
        assert need - d.bytes_to_free <= hard
    if d.outcome is Outcome.WAIT:
        assert need - evictable > hard and alone <= fixed
    if d.outcome is Outcome.REJECT:
        # Final only when it cannot fit alone under the fixed ceiling, whatever is in use.
        assert alone > fixed and (d.needed_bytes, d.limit_bytes) == (alone, fixed)
