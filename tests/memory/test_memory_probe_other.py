from __future__ import annotations

import sys

import pytest
from memtest_helpers import GiB

from memory import AllocatorProbe, CudaProbe, LinuxProbe, Probe, detect_probe


def test_cuda_probe_uses_device_totals_and_allocator_footprint() -> None:
    probe = CudaProbe(
        device_info=lambda: {"total_memory": 140 * GiB, "free_memory": 100 * GiB},
        allocator=lambda: (30 * GiB, 2 * GiB),
    )
    s = probe.read()
    assert s.platform == "cuda"
    assert (s.total_bytes, s.free_bytes, s.device_cap_bytes) == (140 * GiB, 100 * GiB, 140 * GiB)
    assert s.footprint_bytes == 32 * GiB
    assert (s.inactive_bytes, s.active_bytes, s.wired_bytes) == (0, 0, 0)


def test_allocator_probe_is_deterministic() -> None:
    probe = AllocatorProbe(16 * GiB, allocator=lambda: (5 * GiB, 1 * GiB))
    s = probe.read()
    assert s.platform == "allocator"
    assert (s.total_bytes, s.footprint_bytes, s.free_bytes) == (16 * GiB, 6 * GiB, 10 * GiB)
    assert s.device_cap_bytes is None
    assert isinstance(probe, Probe)


def test_allocator_probe_real_mlx_and_validation() -> None:
    s = AllocatorProbe(8 * GiB).read()
    assert s.footprint_bytes == s.allocator_active_bytes + s.allocator_cache_bytes
    assert s.free_bytes == 8 * GiB - s.footprint_bytes
    with pytest.raises(ValueError):
        AllocatorProbe(0)


def test_detect_probe() -> None:
    assert isinstance(detect_probe("allocator"), AllocatorProbe)
    with pytest.raises(ValueError, match="unknown probe kind"):
        detect_probe("windows")
    if sys.platform.startswith("linux"):
        probe = detect_probe()
        assert isinstance(probe, LinuxProbe)  # this machine: MLX CPU build, no CUDA
        assert probe.read().platform == "linux"
