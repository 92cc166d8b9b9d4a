from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from memtest_helpers import GiB, MiB, snap

from memory import AdmissionQuery, Ceiling, Outcome, Tier, compute_ceiling, decide

# Usage 10 GiB (footprint 11 GiB − 1 GiB MLX cache); balanced, dynamic binds at 12 GiB:
# 11 footprint + 1 free + 0 inactive + 0 active.
SNAP = snap(
    footprint_bytes=11 * GiB,
    allocator_cache_bytes=1 * GiB,
    free_bytes=1 * GiB,
    inactive_bytes=0,
    active_bytes=0,
    device_cap_bytes=16 * GiB,
)
CEIL = compute_ceiling(SNAP, Tier.BALANCED)

# (name, query, outcome, bytes_to_free, code)
TABLE = [
    ("fits", AdmissionQuery(predicted_bytes=1 * GiB), Outcome.ADMIT, 0, ""),
    ("fits exactly", AdmissionQuery(predicted_bytes=2 * GiB), Outcome.ADMIT, 0, ""),
    (
        "committed pushes over, evict",
        AdmissionQuery(predicted_bytes=1 * GiB, committed_bytes=2 * GiB, evictable_bytes=4 * GiB),
        Outcome.EVICT,
        1 * GiB,
        "",
    ),
    (
        "evict exactly all",
        AdmissionQuery(predicted_bytes=3 * GiB, evictable_bytes=1 * GiB),
        Outcome.EVICT,
        1 * GiB,
        "",
    ),
    (
        "wait for in-flight",
        AdmissionQuery(predicted_bytes=4 * GiB, evictable_bytes=512 * MiB, releasable_bytes=3 * GiB),
        Outcome.WAIT,
        0,
        "waiting_for_memory",
    ),
    (
        "reject",
        AdmissionQuery(predicted_bytes=4 * GiB, evictable_bytes=512 * MiB, releasable_bytes=1 * GiB),
        Outcome.REJECT,
        0,
        "prefill_memory_exceeded",
    ),
    (
        "reject: prompt alone exceeds ceiling",
        AdmissionQuery(predicted_bytes=13 * GiB, releasable_bytes=1 * GiB),
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
    d = decide(SNAP, CEIL, query)
    assert d.outcome is outcome
    assert d.bytes_to_free == to_free
    assert d.code == code
    assert d.usage_bytes == 10 * GiB
    assert d.needed_bytes == 10 * GiB + query.committed_bytes + query.predicted_bytes
    assert (d.limit_bytes, d.binding, d.predicted_bytes) == (
        12 * GiB,
        "dynamic",
        query.predicted_bytes,
    )
    assert d.reason.startswith(outcome.name + ":")
    assert "dynamic ceiling 12.0 GiB" in d.reason
    assert "device 16.0 GiB" in d.reason
    assert "10.0 GiB in use" in d.reason


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
        ),
    )
    assert d.outcome is Outcome.REJECT
    assert d.request_id == "req-1"
    assert d.at == 0.0  # decide is pure; MemoryGuard stamps the time
    for part in (
        "needs 4.0 GiB on top of 10.0 GiB in use",
        "(10.5 GiB with 512.0 MiB committed)",
        "evicting 512.0 MiB of prefix cache",
        "in-flight requests (1.0 GiB)",
        "shorten the prompt",
        "lower max_tokens",
        "tier 'aggressive'",
    ):
        assert part in d.reason, (part, d.reason)


def test_evict_and_wait_reasons() -> None:
    e = decide(SNAP, CEIL, AdmissionQuery(predicted_bytes=3 * GiB, evictable_bytes=2 * GiB))
    assert "evict 1.0 GiB of prefix cache (of 2.0 GiB evictable)" in e.reason
    w = decide(SNAP, CEIL, AdmissionQuery(predicted_bytes=4 * GiB, releasable_bytes=3 * GiB))
    assert "release 3.0 GiB" in w.reason and "waiting for memory" in w.reason


def test_custom_ceiling_reason() -> None:
    c = compute_ceiling(SNAP, Tier.CUSTOM, custom_bytes=11 * GiB)
    d = decide(SNAP, c, AdmissionQuery(predicted_bytes=2 * GiB))
    assert d.outcome is Outcome.REJECT and "custom ceiling 11.0 GiB" in d.reason
    assert "raise the custom ceiling" in d.reason


def test_negative_query_rejected() -> None:
    with pytest.raises(ValueError):
        AdmissionQuery(predicted_bytes=-1)


sizes = st.integers(min_value=0, max_value=64 * GiB)


@given(
    footprint=sizes,
    cache=sizes,
    hard=st.integers(min_value=0, max_value=128 * GiB),
    predicted=sizes,
    committed=sizes,
    evictable=sizes,
    releasable=sizes,
)
def test_decide_properties(
    footprint: int,
    cache: int,
    hard: int,
    predicted: int,
    committed: int,
    evictable: int,
    releasable: int,
) -> None:
    s = snap(footprint_bytes=footprint, allocator_cache_bytes=min(cache, footprint))
    ceiling = Ceiling(hard, "static", {"static": hard}, Tier.BALANCED)
    q = AdmissionQuery(predicted, committed, evictable, releasable)
    d = decide(s, ceiling, q)
    usage = footprint - min(cache, footprint)
    need = usage + committed + predicted
    assert d.needed_bytes == need
    if need > hard:
        assert d.outcome is not Outcome.ADMIT
    else:
        assert d.outcome is Outcome.ADMIT
    if d.outcome is Outcome.EVICT:
        assert 0 < d.bytes_to_free <= evictable
        assert need - d.bytes_to_free <= hard
    if d.outcome is Outcome.WAIT:
        assert need - evictable > hard and need - evictable - releasable <= hard
    if d.outcome is Outcome.REJECT:
        assert need - evictable - releasable > hard
