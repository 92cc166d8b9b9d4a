from __future__ import annotations

import pytest
from memtest_helpers import GiB, snap

from memory import CeilingConfig, Tier, compute_ceiling

# (name, snapshot overrides, tier, custom, expected hard, expected binding)
CASES = [
    # 64 GiB machine, lots free: static binds, reserve depends on tier.
    ("large safe", {"free_bytes": 50 * GiB}, Tier.SAFE, None, 56 * GiB, "static"),
    ("large balanced", {"free_bytes": 50 * GiB}, Tier.BALANCED, None, 58 * GiB, "static"),
    ("large aggressive", {"free_bytes": 50 * GiB}, Tier.AGGRESSIVE, None, 60 * GiB, "static"),
    # small machine (16 GiB): every tier reserves 4 GiB.
    (
        "small safe",
        {"total_bytes": 16 * GiB, "free_bytes": 6 * GiB},
        Tier.SAFE,
        None,
        12 * GiB,
        "static",
    ),
    (
        "small aggr",
        {"total_bytes": 16 * GiB, "free_bytes": 6 * GiB},
        Tier.AGGRESSIVE,
        None,
        12 * GiB,
        "static",
    ),
    # busy machine: dynamic = 10 + 2 free + 4 inactive + ratio × 8 active.
    (
        "busy safe",
        {"free_bytes": 2 * GiB},
        Tier.SAFE,
        None,
        16 * GiB + int(8 * GiB * 0.2),
        "dynamic",
    ),
    ("busy balanced", {"free_bytes": 2 * GiB}, Tier.BALANCED, None, 20 * GiB, "dynamic"),
    (
        "busy aggressive",
        {"free_bytes": 2 * GiB},
        Tier.AGGRESSIVE,
        None,
        16 * GiB + int(8 * GiB * 0.8),
        "dynamic",
    ),
    # device cap below both.
    ("device", {"device_cap_bytes": 21 * GiB}, Tier.AGGRESSIVE, None, 21 * GiB, "device"),
    # custom: the user's number, but never above the device cap.
    ("custom", {}, Tier.CUSTOM, 40 * GiB, 40 * GiB, "custom"),
    ("custom capped", {"device_cap_bytes": 21 * GiB}, Tier.CUSTOM, 40 * GiB, 21 * GiB, "device"),
    ("custom above total", {}, Tier.CUSTOM, 100 * GiB, 100 * GiB, "custom"),
]


@pytest.mark.parametrize(
    ("overrides", "tier", "custom", "hard", "binding"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_ceiling_table(
    overrides: dict[str, int], tier: Tier, custom: int | None, hard: int, binding: str
) -> None:
    c = compute_ceiling(snap(**overrides), tier, custom_bytes=custom)
    assert (c.hard_bytes, c.binding, c.tier) == (hard, binding, tier)
    assert c.components[binding] == hard
    assert all(v > 0 for v in c.components.values())
    assert c.hard_bytes == min(c.components.values())


def test_components_and_describe() -> None:
    c = compute_ceiling(snap(free_bytes=2 * GiB, device_cap_bytes=48 * GiB), Tier.BALANCED)
    assert dict(c.components) == {"static": 58 * GiB, "dynamic": 20 * GiB, "device": 48 * GiB}
    assert c.describe() == "dynamic ceiling 20.0 GiB (static 58.0 GiB, dynamic 20.0 GiB, device 48.0 GiB)"
    custom = compute_ceiling(snap(), Tier.CUSTOM, custom_bytes=12 * GiB)
    assert set(custom.components) == {"custom"}


@pytest.mark.parametrize("custom", [None, 0, -1])
def test_custom_requires_positive_bytes(custom: int | None) -> None:
    with pytest.raises(ValueError):
        compute_ceiling(snap(), Tier.CUSTOM, custom_bytes=custom)


def test_non_positive_components_are_dropped() -> None:
    # A 3 GiB machine: static is negative and dropped; dynamic binds.
    c = compute_ceiling(
        snap(
            total_bytes=3 * GiB,
            footprint_bytes=1 * GiB,
            free_bytes=1 * GiB,
            inactive_bytes=0,
            active_bytes=0,
        ),
        Tier.SAFE,
    )
    assert "static" not in c.components
    assert (c.binding, c.hard_bytes) == ("dynamic", 2 * GiB)
    # Nothing positive at all: admit nothing.
    z = compute_ceiling(
        snap(total_bytes=1 * GiB, footprint_bytes=0, free_bytes=0, inactive_bytes=0, active_bytes=0),
        Tier.SAFE,
    )
    assert z.hard_bytes == 0


def test_config_overrides() -> None:
    cfg = CeilingConfig(
        reserve_bytes={Tier.SAFE: 10 * GiB, Tier.BALANCED: 1 * GiB, Tier.AGGRESSIVE: 0},
        small_machine_bytes=8 * GiB,
        small_machine_reserve_bytes=2 * GiB,
        reclaim_ratio={Tier.SAFE: 0.0, Tier.BALANCED: 0.0, Tier.AGGRESSIVE: 1.0},
    )
    assert compute_ceiling(snap(), Tier.SAFE, cfg).hard_bytes == 44 * GiB  # dynamic, ratio 0
    assert compute_ceiling(snap(total_bytes=6 * GiB), Tier.BALANCED, cfg).components["static"] == 4 * GiB
    assert CeilingConfig().reserve_bytes[Tier.BALANCED] == 6 * GiB
