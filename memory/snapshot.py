"""The value every probe returns: one consistent reading of memory, taken at one instant.

Policy code (ceilings, decisions) only ever sees this frozen value, never the OS or MLX,
so it can be tested with hand-written snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory as seen by a probe.

    ``footprint_bytes`` is what counts as this process's usage. It includes
    ``allocator_cache_bytes``: buffers MLX has freed but keeps for reuse, which
    ``mx.clear_cache()`` returns to the system, so policy treats them as reclaimable.
    """

    platform: str  # "macos" | "linux" | "cuda" | "allocator"
    total_bytes: int  # physical RAM (or GPU total on CUDA)
    footprint_bytes: int  # this process's own footprint: what counts as "usage"
    allocator_active_bytes: int  # mx.get_active_memory()
    allocator_cache_bytes: int  # mx.get_cache_memory(): reclaimable by mx.clear_cache()
    free_bytes: int
    inactive_bytes: int
    active_bytes: int
    wired_bytes: int
    device_cap_bytes: int | None  # wired limit / working set / CUDA total / cgroup max
    taken_at: float  # time.monotonic()
