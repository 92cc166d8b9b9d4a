"""CUDA probe: this process's device memory as the driver counts it.

On CUDA the device, not host RAM, is what runs out, so total/free/cap are the GPU's.
The footprint is NVML's per-process figure (see :mod:`.nvml`): it includes MLX's buffer
cache and the buffers MLX freed into CUDA's memory pool, which MLX's own counters miss (on
the H200 after a burst: 138 GB by the driver against 18 GB active + 0.2 GB cached). Without
NVML (no ``nvidia-ml-py``, no driver library) the probe falls back to MLX's counters and
``mx.device_info()``, and says so in ``usage_source``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ..snapshot import MemorySnapshot
from .base import mlx_allocator_bytes
from .nvml import (
    SOURCE_ALLOCATOR,
    NvmlReader,
    NvmlReading,
    PynvmlReader,
    pid_is_visible,
    process_footprint,
)

log = logging.getLogger("mlx_headroom.memory")


def _device_info() -> Mapping[str, Any]:
    import mlx.core as mx

    return dict(mx.device_info())


def snapshot_from_cuda(
    info: Mapping[str, Any],
    *,
    allocator_active: int,
    allocator_cache: int,
    taken_at: float,
    footprint: int | None = None,
    usage_source: str = SOURCE_ALLOCATOR,
) -> MemorySnapshot:
    """Build a snapshot from device totals and MLX's counters (pure). ``footprint``
    defaults to MLX's active + cache (the blind figure, for when NVML is unavailable)."""
    total = int(info.get("total_memory", 0))
    return MemorySnapshot(
        platform="cuda",
        total_bytes=total,
        footprint_bytes=allocator_active + allocator_cache if footprint is None else footprint,
        allocator_active_bytes=allocator_active,
        allocator_cache_bytes=allocator_cache,
        free_bytes=int(info.get("free_memory", 0)),
        inactive_bytes=0,
        active_bytes=0,
        wired_bytes=0,
        device_cap_bytes=total or None,
        taken_at=taken_at,
        usage_source=usage_source,
    )


def _open_nvml() -> NvmlReader | None:
    try:
        return PynvmlReader()
    except Exception as exc:  # ImportError, NVMLError_*: any of them means "no NVML"
        log.warning("NVML unavailable (%s): device memory falls back to MLX's counters, "
                    "which miss CUDA's memory pool", exc)
        return None


class CudaProbe:
    """Reads GPU memory state (requires ``mx.cuda.is_available()``).

    ``nvml`` reads the driver: ``"auto"`` opens NVML through ``nvidia-ml-py`` if it can,
    ``None`` skips it, and tests pass a function returning fake :class:`NvmlReading` s.
    """

    def __init__(
        self,
        *,
        device_info: Callable[[], Mapping[str, Any]] | None = None,
        allocator: Callable[[], tuple[int, int]] | None = None,
        nvml: NvmlReader | Literal["auto"] | None = "auto",
        pid: int | None = None,
        is_other_process: Callable[[int], bool] = pid_is_visible,
    ) -> None:
        self._device_info = device_info or _device_info
        self._allocator = allocator or mlx_allocator_bytes
        self._nvml: NvmlReader | None = _open_nvml() if nvml == "auto" else nvml
        self._pid = os.getpid() if pid is None else pid
        self._is_other = is_other_process
        self._nvml_failed = False

    def _read_nvml(self) -> NvmlReading | None:
        if self._nvml is None:
            return None
        try:
            reading = self._nvml()
        except Exception as exc:  # a driver hiccup: fall back for this read, say so once
            if not self._nvml_failed:
                log.warning("NVML read failed (%s): using MLX's counters for now", exc)
            self._nvml_failed = True
            return None
        self._nvml_failed = False
        return reading

    def read(self) -> MemorySnapshot:
        active, cache = self._allocator()
        reading = self._read_nvml()
        taken_at = time.monotonic()
        if reading is None:
            return snapshot_from_cuda(
                self._device_info(), allocator_active=active, allocator_cache=cache,
                taken_at=taken_at,
            )
        footprint, source = process_footprint(
            reading, pid=self._pid, allocator_bytes=active + cache, is_other_process=self._is_other
        )
        return snapshot_from_cuda(
            {"total_memory": reading.total_bytes, "free_memory": reading.free_bytes},
            allocator_active=active,
            allocator_cache=cache,
            taken_at=taken_at,
            footprint=footprint,
            usage_source=source,
        )
