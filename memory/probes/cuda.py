"""CUDA probe: NVML totals through ``mx.device_info()``, MLX's allocator as the footprint.

On CUDA the device, not host RAM, is what runs out, so total/free/cap are the GPU's.
``free_memory`` is system-wide and fresh on each call (other processes count).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ..snapshot import MemorySnapshot
from .base import mlx_allocator_bytes


def _device_info() -> Mapping[str, Any]:
    import mlx.core as mx

    return dict(mx.device_info())


def snapshot_from_cuda(
    info: Mapping[str, Any], *, allocator_active: int, allocator_cache: int, taken_at: float
) -> MemorySnapshot:
    """Build a snapshot from ``mx.device_info()`` and MLX's counters (pure)."""
    total = int(info.get("total_memory", 0))
    return MemorySnapshot(
        platform="cuda",
        total_bytes=total,
        footprint_bytes=allocator_active + allocator_cache,
        allocator_active_bytes=allocator_active,
        allocator_cache_bytes=allocator_cache,
        free_bytes=int(info.get("free_memory", 0)),
        inactive_bytes=0,
        active_bytes=0,
        wired_bytes=0,
        device_cap_bytes=total or None,
        taken_at=taken_at,
    )


class CudaProbe:
    """Reads GPU memory state through MLX (requires ``mx.cuda.is_available()``)."""

    def __init__(
        self,
        *,
        device_info: Callable[[], Mapping[str, Any]] | None = None,
        allocator: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        self._device_info = device_info or _device_info
        self._allocator = allocator or mlx_allocator_bytes

    def read(self) -> MemorySnapshot:
        active, cache = self._allocator()
        return snapshot_from_cuda(
            self._device_info(),
            allocator_active=active,
            allocator_cache=cache,
            taken_at=time.monotonic(),
        )
