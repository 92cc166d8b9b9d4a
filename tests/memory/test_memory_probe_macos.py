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


# ---- the probe against the kernel's failure modes, through a fake libc ------------------

from memory import ProbeError, Tier, compute_ceiling  # noqa: E402
from memory.probes.macos import HOST_INFO_MAX, MIG_ARRAY_TOO_LARGE, MacOSProbe  # noqa: E402
from tests.fake_darwin import KERN_FAILURE, FakeDarwin  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def probe(fake: FakeDarwin, clock: Clock | None = None, **kwargs: object) -> MacOSProbe:
    return MacOSProbe(
        libc=fake, allocator=lambda: (0, 0), recommended_working_set=lambda: None,
        clock=clock or Clock(), **kwargs,  # type: ignore[arg-type]
    )


def dynamic(p: MacOSProbe) -> int:
    return compute_ceiling(p.read(), Tier.BALANCED).components["dynamic"]


def test_mig_array_too_large_is_retried_with_the_kernels_count() -> None:
    # macOS 27: fine for a few calls, then the cached reply is 40 integers and a count of
    # 38 gets -307. The probe retries with 40 and keeps using it.
    fake = FakeDarwin(kernel_count=40, mig_after=3)
    clock = Clock()
    p = probe(fake, clock, vm_interval_s=0.0)
    snaps = []
    for _ in range(8):
        snaps.append(p.read())
        clock.now += 0.01
    page = fake.page_size
    assert all(s.active_bytes == fake.active_pages * page for s in snaps)
    assert all(s.inactive_bytes == fake.inactive_pages * page for s in snaps)
    assert (38, MIG_ARRAY_TOO_LARGE) in fake.vm_calls and (40, 0) in fake.vm_calls
    assert fake.vm_calls[-1] == (40, 0)  # the kernel's count is kept: no -307 every call
    assert [rc for _, rc in fake.vm_calls].count(MIG_ARRAY_TOO_LARGE) == 1
    assert p.vm_failures == 0


@pytest.mark.parametrize(
    ("rc", "count"), [(KERN_FAILURE, 0), (MIG_ARRAY_TOO_LARGE, HOST_INFO_MAX + 1)]
)
def test_permanently_failing_vm_statistics_count_nothing_but_free(rc: int, count: int) -> None:
    # A failing call never raises out of read(); with no sample, inactive and active count
    # as zero (the dynamic ceiling is footprint + free: lower than the truth, never higher).
    fake = FakeDarwin(fail_rc=rc, fail_count=count)
    clock = Clock()
    p = probe(fake, clock)
    for _ in range(3):
        s = p.read()
        clock.now += 1.0
    assert (s.inactive_bytes, s.active_bytes) == (0, 0)
    assert s.free_bytes == (fake.free_pages + fake.speculative_pages) * fake.page_size
    assert s.footprint_bytes == fake.current_footprint()
    assert p.vm_failures == 3
    assert len(fake.vm_calls) == 3  # an oversized count is not retried


def test_a_failing_call_keeps_the_last_good_sample_for_a_while() -> None:
    fake = FakeDarwin()
    clock = Clock()
    p = probe(fake, clock, vm_max_age_s=30.0)
    good = p.read()
    fake.fail_rc = KERN_FAILURE
    clock.now += 20.0
    assert p.read().inactive_bytes == good.inactive_bytes  # the sample is 20 s old: kept
    clock.now += 11.0
    assert p.read().inactive_bytes == 0  # 31 s: too old to trust
    fake.fail_rc = None
    clock.now += 1.0
    assert p.read().inactive_bytes == good.inactive_bytes and p.vm_failures == 0


def test_stale_counts_do_not_count_our_allocation_as_free() -> None:
    # The rate limiter answers with the counts of a second ago while this process
    # allocates 4 GiB: free must come fresh (sysctl), or the 4 GiB counts twice, as our
    # footprint and still as free, and the dynamic ceiling rises by 4 GiB.
    fake = FakeDarwin()
    p = probe(fake, vm_interval_s=0.0)
    before = dynamic(p)
    fake.rate_limited = True
    fake.allocate(4 * GiB)
    s = p.read()
    assert s.active_bytes == (fake.active_pages - 4 * GiB // fake.page_size) * fake.page_size  # stale
    assert s.free_bytes == (fake.free_pages + fake.speculative_pages) * fake.page_size  # fresh
    assert dynamic(p) <= before


def test_without_the_sysctl_free_moves_with_our_footprint() -> None:
    # An OS without vm.page_free_count: the sample's free count is paired with the
    # footprint read with it, and moved by how much the footprint has grown since.
    fake = FakeDarwin(sysctl_vm_counts=False)
    clock = Clock()
    p = probe(fake, clock)  # samples VM statistics at most once a second
    before = p.read()
    fake.allocate(4 * GiB)
    clock.now += 0.5
    after = p.read()
    assert len(fake.vm_calls) == 1
    assert after.free_bytes == before.free_bytes - 4 * GiB
    assert after.footprint_bytes == before.footprint_bytes + 4 * GiB


def test_vm_statistics_are_sampled_at_most_once_a_second() -> None:
    fake = FakeDarwin()
    clock = Clock()
    p = probe(fake, clock)
    for _ in range(20):
        p.read()
        clock.now += 0.1
    assert len(fake.vm_calls) == 2  # at 100.0 and 101.0


def test_no_free_figure_at_all_is_a_probe_error() -> None:
    fake = FakeDarwin(sysctl_vm_counts=False, fail_rc=KERN_FAILURE)
    with pytest.raises(ProbeError):
        probe(fake).read()
    fake = FakeDarwin(fail_rusage=True)
    with pytest.raises(ProbeError):
        probe(fake).read()


def test_the_ceiling_follows_a_wired_limit_changed_at_runtime() -> None:
    # `sudo sysctl iogpu.wired_limit_mb=...` while the server runs: the device cap follows
    # with the next VM sample (at most once per interval), not on every read.
    fake = FakeDarwin(wired_limit_mb=24576)
    clock = Clock()
    p = probe(fake, clock)
    assert p.read().device_cap_bytes == 24 * GiB
    fake.wired_limit_mb = 40960
    clock.now += 0.5
    assert p.read().device_cap_bytes == 24 * GiB  # inside the interval: the last reading
    clock.now += 0.5
    snap = p.read()
    assert snap.device_cap_bytes == 40 * GiB
    assert compute_ceiling(snap, Tier.AGGRESSIVE).components["device"] == 40 * GiB
    fake.wired_limit_mb = 0  # back to the default: the recommended working set (none here)
    clock.now += 1.0
    assert p.read().device_cap_bytes is None
