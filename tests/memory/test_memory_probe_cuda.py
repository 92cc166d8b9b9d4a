"""The CUDA probe counts what the driver counts, from fake NVML readings.

The numbers are the ones measured on the H200 after a burst of 64 requests: the driver held
138 GB for the server while MLX counted 18 GB active and 0.2 GB cached (the rest sat in
CUDA's memory pool), another process held memory too, and the device had 5.5 GB free.
"""

from __future__ import annotations

from types import MappingProxyType

import pytest
from memtest_helpers import GiB, MiB

from memory import AdmissionQuery, CudaProbe, MemoryGuard, NvmlReading, Outcome, Tier
from memory.probes.nvml import PynvmlReader, process_footprint

OURS, OTHER, HOST_PID_OF_US = 4242, 777, 99_001
TOTAL = 140 * GiB
ACTIVE, CACHE = 18 * GiB, 200 * MiB


def reading(free: int, processes: dict[int, int | None]) -> NvmlReading:
    return NvmlReading(TOTAL, free, MappingProxyType(processes))


def probe(nvml, *, allocator=lambda: (ACTIVE, CACHE), visible=frozenset({OTHER})) -> CudaProbe:
    return CudaProbe(
        device_info=lambda: {"total_memory": TOTAL, "free_memory": 99 * GiB},
        allocator=allocator,
        nvml=nvml,
        pid=OURS,
        is_other_process=lambda pid: pid in visible,
    )


def test_usage_is_the_drivers_per_process_figure_pool_included() -> None:
    s = probe(lambda: reading(int(5.5 * GiB), {OURS: 138 * GiB, OTHER: 2 * GiB})).read()
    assert s.usage_source == "nvml_process"
    assert s.footprint_bytes == 138 * GiB  # not MLX's 18.2 GiB
    assert (s.total_bytes, s.free_bytes, s.device_cap_bytes) == (TOTAL, int(5.5 * GiB), TOTAL)
    assert (s.allocator_active_bytes, s.allocator_cache_bytes) == (ACTIVE, CACHE)
    assert s.untracked_bytes == 138 * GiB - ACTIVE - CACHE  # the pool (and the context)


def test_without_our_pid_it_is_total_minus_free_minus_certain_others() -> None:
    # In a container the driver lists host pids: we appear as HOST_PID_OF_US, which is not
    # visible in our namespace, so it may be us and counts as ours; OTHER is visible.
    s = probe(lambda: reading(10 * GiB, {HOST_PID_OF_US: 100 * GiB, OTHER: 20 * GiB})).read()
    assert s.usage_source == "nvml_device_minus_others"
    assert s.footprint_bytes == TOTAL - 10 * GiB - 20 * GiB


def test_a_figure_the_driver_does_not_give_falls_back_to_the_device_arithmetic() -> None:
    s = probe(lambda: reading(40 * GiB, {OURS: None, OTHER: 30 * GiB})).read()
    assert s.usage_source == "nvml_device_minus_others"
    assert s.footprint_bytes == TOTAL - 40 * GiB - 30 * GiB


def test_never_less_than_what_mlx_itself_holds() -> None:
    fp, source = process_footprint(reading(0, {OURS: 1 * GiB}), pid=OURS, allocator_bytes=5 * GiB)
    assert (fp, source) == (5 * GiB, "nvml_process")
    fp, _ = process_footprint(reading(TOTAL, {}), pid=OURS, allocator_bytes=3 * GiB)
    assert fp == 3 * GiB


def test_nvml_errors_fall_back_to_mlx_counters_and_recover() -> None:
    calls = {"n": 0}

    def flaky() -> NvmlReading:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return reading(5 * GiB, {OURS: 50 * GiB})

    p = probe(flaky)
    first = p.read()
    assert first.usage_source == "mlx_allocator"
    assert first.footprint_bytes == ACTIVE + CACHE
    assert first.free_bytes == 99 * GiB  # from mx.device_info()
    assert p.read().usage_source == "nvml_process"


def test_no_nvml_is_mlxs_counters() -> None:
    s = probe(None).read()
    assert (s.usage_source, s.footprint_bytes, s.untracked_bytes) == ("mlx_allocator", ACTIVE + CACHE, 0)


def test_auto_without_a_driver_falls_back_instead_of_failing() -> None:
    with pytest.raises(Exception):  # noqa: B017 (ImportError or an NVMLError, whichever this machine has)
        PynvmlReader()
    s = CudaProbe(device_info=lambda: {"total_memory": TOTAL, "free_memory": 1 * GiB},
                  allocator=lambda: (1, 2)).read()
    assert (s.usage_source, s.footprint_bytes) == ("mlx_allocator", 3)


def test_after_burst_the_guard_hands_the_pool_back_and_admits_a_60k_prompt() -> None:
    """The H200 scenario end to end: before the hand-back a 60k-token prompt (8.1 GiB) does
    not fit (the pool holds 120 GB); it must not be refused for good; the hand-back
    (measured: 136.7 GB → 16.3 GB, free 6.1 → 123.8 GiB) returns the pool and it is admitted."""
    state = {"mine": 138 * GiB, "free": int(5.5 * GiB), "cache": CACHE}
    p = probe(lambda: reading(state["free"], {OURS: state["mine"], OTHER: 300 * MiB}),
              allocator=lambda: (ACTIVE, state["cache"]))
    guard = MemoryGuard(p, tier=Tier.BALANCED)
    need = int(8.1 * GiB)
    query = AdmissionQuery(predicted_bytes=need, solo_bytes=need, baseline_bytes=16 * GiB)

    unreclaimed = guard.check(query)
    assert unreclaimed.outcome is Outcome.WAIT  # today: REJECT, "never retry"

    def hand_back() -> None:
        # what MLX holds active, plus the CUDA context
        state["free"] += state["mine"] - int(18.5 * GiB)
        state["mine"], state["cache"] = int(18.5 * GiB), 0

    decision = guard.check(query, reclaim=hand_back)
    assert decision.outcome is Outcome.ADMIT, decision.reason
    assert guard.hand_backs == 1
    assert decision.usage_bytes == int(18.5 * GiB)
