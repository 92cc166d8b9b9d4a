"""Allocator probe: MLX's own accounting against a chosen total.

Deterministic and OS-independent: tests use it, and ``AllocatorProbe(total_bytes=16 GiB)``
simulates a smaller machine on a big one.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable

from ..snapshot import MemorySnapshot
from .base import mlx_allocator_bytes


def _physical_total() -> int:
    """Physical RAM: POSIX sysconf where available (Linux, macOS), else psutil."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        psutil = importlib.import_module("psutil")  # untyped; imported only if needed
        return int(psutil.virtual_memory().total)


class AllocatorProbe:
    """footprint = MLX active + cache; free = total − footprint; no device cap."""

    def __init__(
        self,
        total_bytes: int | None = None,
        *,
        allocator: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        if total_bytes is not None and total_bytes <= 0:
            raise ValueError(f"total_bytes must be positive, got {total_bytes}")
        self._total = total_bytes if total_bytes is not None else _physical_total()
        self._allocator = allocator or mlx_allocator_bytes

    def read(self) -> MemorySnapshot:
        active, cache = self._allocator()
        footprint = active + cache
        return MemorySnapshot(
            platform="allocator",
            total_bytes=self._total,
            footprint_bytes=footprint,
            allocator_active_bytes=active,
            allocator_cache_bytes=cache,
            free_bytes=max(0, self._total - footprint),
            inactive_bytes=0,
            active_bytes=0,
            wired_bytes=0,
            device_cap_bytes=None,
            taken_at=time.monotonic(),
        )
