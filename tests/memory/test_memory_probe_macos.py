"""macOS parsing, testable anywhere: the structs, the sysctl logic, the page arithmetic."""

from __future__ import annotations

import ctypes

import pytest
from memtest_helpers import GiB, MiB

from memory.probes.macos import (
    HOST_VM_INFO64_COUNT,
    RusageInfoV4,
    VMStatistics64,
    device_cap,
    snapshot_from_vm_stats,
    wired_limit_bytes,
)


def test_rusage_info_v4_is_the_full_296_bytes() -> None:
    # A shorter buffer lets proc_pid_rusage write past its end.
    assert ctypes.sizeof(RusageInfoV4) == 296
    assert RusageInfoV4.ri_phys_footprint.offset == 72
    assert RusageInfoV4.ri_runnable_time.offset == 288


def test_vm_statistics64_layout() -> None:
    assert ctypes.sizeof(VMStatistics64) == 152
    assert HOST_VM_INFO64_COUNT == 38
    assert VMStatistics64.purgeable_count.offset == 88
    assert VMStatistics64.compressor_page_count.offset == 128
    assert VMStatistics64.total_uncompressed_pages_in_compressor.offset == 144


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"iogpu.wired_limit_mb": 0}, None),  # 0 = the default limit
        ({"iogpu.wired_limit_mb": 24576}, 24 * GiB),
        ({}, None),  # sysctl absent (older macOS, Intel)
    ],
)
def test_wired_limit_from_fake_sysctl(values: dict[str, int], expected: int | None) -> None:
    assert wired_limit_bytes(values.get) == expected


@pytest.mark.parametrize(
    ("wired", "recommended", "expected"),
    [
        (24 * GiB, 21 * GiB, 24 * GiB),  # a user-set wired limit wins
        (None, 21 * GiB, 21 * GiB),
        (None, None, None),
        (None, 0, None),
    ],
)
def test_device_cap(wired: int | None, recommended: int | None, expected: int | None) -> None:
    assert device_cap(wired, recommended) == expected


def test_snapshot_from_fake_vm_stats() -> None:
    page = 16384
    vm = VMStatistics64(free_count=1000, active_count=2000, inactive_count=3000, wire_count=400)
    vm.speculative_count = 100  # included in free_count already
    s = snapshot_from_vm_stats(
        vm,
        page_size=page,
        total_bytes=32 * GiB,
        footprint_bytes=5 * GiB,
        allocator_active=4 * GiB,
        allocator_cache=512 * MiB,
        device_cap_bytes=device_cap(wired_limit_bytes({"iogpu.wired_limit_mb": 0}.get), 21 * GiB),
        taken_at=1.5,
    )
    assert s.platform == "macos"
    assert s.free_bytes == 1000 * page
    assert s.active_bytes == 2000 * page
    assert s.inactive_bytes == 3000 * page
    assert s.wired_bytes == 400 * page
    assert s.device_cap_bytes == 21 * GiB
    assert (s.footprint_bytes, s.allocator_cache_bytes, s.taken_at) == (5 * GiB, 512 * MiB, 1.5)
