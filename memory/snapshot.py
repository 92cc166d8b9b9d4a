"""The value every probe returns: one consistent reading of memory, taken at one instant.

Policy code (ceilings, decisions) only ever sees this frozen value, never the OS or MLX,
so it can be tested with hand-written snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory as seen by a probe.

    ``footprint_bytes`` is this process's usage as the device (or OS) counts it, and what
    admission counts. It includes ``allocator_cache_bytes`` (buffers MLX has freed but keeps
    for reuse) and, on CUDA, memory that MLX handed to CUDA's pool and no longer counts at
    all (:attr:`untracked_bytes`). Both come back with ``mx.synchronize()`` +
    ``mx.clear_cache()``; the guard asks the engine to do that before it concludes that
    something does not fit. ``usage_source`` names where the footprint came from.
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
    usage_source: str = "mlx_allocator"  # e.g. "nvml_process", "rss", "phys_footprint"

    @property
    def untracked_bytes(self) -> int:
        """Footprint that MLX's counters do not explain: the CUDA context and pool on CUDA,
        the interpreter and libraries in an RSS."""
        return max(0, self.footprint_bytes - self.allocator_active_bytes - self.allocator_cache_bytes)
