"""What the NVIDIA driver says about the device and the processes using it (NVML).

MLX's counters miss memory on CUDA: freed buffers go through ``cudaFreeAsync`` into CUDA's
memory pool, which keeps them, and neither ``mx.get_active_memory()`` nor
``mx.get_cache_memory()`` sees them (MLX 0.32's CUDA allocator). The driver's per-process
figure, the one ``nvidia-smi --query-compute-apps=pid,used_memory`` prints, does.

:class:`NvmlReading` is a plain value, so the probe's arithmetic is tested with fake
readings; :class:`PynvmlReader` takes real ones through ``nvidia-ml-py`` (the ``cuda``
extra), imported lazily so that nothing here needs a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class NvmlReading:
    """One read of the device: its memory and every compute process on it.

    ``processes`` maps a pid, as the driver knows it, to the bytes it holds; ``None`` when
    the driver does not say (some containers, some drivers).
    """

    total_bytes: int
    free_bytes: int
    processes: Mapping[int, int | None] = field(default_factory=lambda: MappingProxyType({}))


NvmlReader = Callable[[], NvmlReading]

SOURCE_PROCESS = "nvml_process"
SOURCE_DEVICE_MINUS_OTHERS = "nvml_device_minus_others"
SOURCE_ALLOCATOR = "mlx_allocator"


def pid_is_visible(pid: int) -> bool:
    """True when ``pid`` is a process in our own pid namespace (so, listed by NVML under a
    pid other than ours, it is certainly another process, not us under a host pid)."""
    return os.path.exists(f"/proc/{pid}")


def process_footprint(
    reading: NvmlReading,
    *,
    pid: int,
    allocator_bytes: int,
    is_other_process: Callable[[int], bool] = pid_is_visible,
) -> tuple[int, str]:
    """This process's device memory and where the figure came from (pure).

    1. The driver lists our pid with a figure: that figure (``nvml_process``).
    2. Otherwise (inside a container the driver lists host pids, which are not ours):
       total − free − the memory of processes that are certainly others, i.e. visible in
       our own pid namespace (``nvml_device_minus_others``). A listed process we cannot
       see may be ourselves, so it is counted as ours: that over-counts rather than
       admits what does not fit.

    Either way never less than what MLX itself holds (``allocator_bytes``): the driver
    cannot hold less than the buffers MLX has live or cached.
    """
    own = reading.processes.get(pid)
    if own is not None:
        return max(int(own), allocator_bytes), SOURCE_PROCESS
    others = sum(
        int(used)
        for other, used in reading.processes.items()
        if other != pid and used is not None and is_other_process(other)
    )
    derived = reading.total_bytes - reading.free_bytes - others
    return max(derived, allocator_bytes), SOURCE_DEVICE_MINUS_OTHERS


def visible_device(pynvml: Any) -> Any:
    """The NVML handle of the device MLX uses: the first of ``CUDA_VISIBLE_DEVICES`` (NVML
    numbers devices ignoring that variable), else device 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(visible))
    if visible.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(visible)
    return pynvml.nvmlDeviceGetHandleByIndex(0)


class PynvmlReader:
    """Reads NVML through ``nvidia-ml-py``. Construction raises when NVML is unavailable
    (the package, the driver library or the device); the CUDA probe then falls back."""

    def __init__(self) -> None:
        import pynvml  # type: ignore[import-not-found, unused-ignore]

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = visible_device(pynvml)

    def __call__(self) -> NvmlReading:
        nvml, handle = self._nvml, self._handle
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        processes = {
            int(p.pid): (None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        }
        return NvmlReading(int(memory.total), int(memory.free), MappingProxyType(processes))
