"""macOS probe: Mach VM page counts, the process's physical footprint, the GPU wired limit.

- ``host_statistics64(mach_host_self(), HOST_VM_INFO64, ...)`` gives page counts;
  ``host_page_size`` converts them to bytes. ``free_count`` already includes speculative
  pages (``vm_stat`` prints ``free_count - speculative_count`` as "Pages free").
- ``proc_pid_rusage(getpid(), RUSAGE_INFO_V4, &buf)`` gives ``ri_phys_footprint``, the number
  Activity Monitor and jetsam use. The buffer MUST be the full ``rusage_info_v4`` (296
  bytes): the kernel writes the whole struct, and a shorter buffer gets overrun.
- ``sysctl iogpu.wired_limit_mb`` (0 = the default) and MLX's
  ``max_recommended_working_set_size`` give the device cap: the wired limit if set,
  else the recommended working set.

The ctypes structures and parsing functions are importable (and tested) on Linux; only
:meth:`MacOSProbe.read` needs Darwin.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable
from typing import Any

from ..snapshot import MemorySnapshot
from .base import mlx_allocator_bytes

HOST_VM_INFO64 = 4
RUSAGE_INFO_V4 = 4
KERN_SUCCESS = 0
MiB = 1024 * 1024


class VMStatistics64(ctypes.Structure):
    """``struct vm_statistics64`` from ``<mach/vm_statistics.h>`` (152 bytes)."""

    _fields_ = [
        ("free_count", ctypes.c_uint32),
        ("active_count", ctypes.c_uint32),
        ("inactive_count", ctypes.c_uint32),
        ("wire_count", ctypes.c_uint32),
        ("zero_fill_count", ctypes.c_uint64),
        ("reactivations", ctypes.c_uint64),
        ("pageins", ctypes.c_uint64),
        ("pageouts", ctypes.c_uint64),
        ("faults", ctypes.c_uint64),
        ("cow_faults", ctypes.c_uint64),
        ("lookups", ctypes.c_uint64),
        ("hits", ctypes.c_uint64),
        ("purges", ctypes.c_uint64),
        ("purgeable_count", ctypes.c_uint32),
        ("speculative_count", ctypes.c_uint32),
        ("decompressions", ctypes.c_uint64),
        ("compressions", ctypes.c_uint64),
        ("swapins", ctypes.c_uint64),
        ("swapouts", ctypes.c_uint64),
        ("compressor_page_count", ctypes.c_uint32),
        ("throttled_count", ctypes.c_uint32),
        ("external_page_count", ctypes.c_uint32),
        ("internal_page_count", ctypes.c_uint32),
        ("total_uncompressed_pages_in_compressor", ctypes.c_uint64),
    ]


# HOST_VM_INFO64_COUNT: the struct size in integer_t (4-byte) units.
HOST_VM_INFO64_COUNT = ctypes.sizeof(VMStatistics64) // 4

_RUSAGE_V4_U64_FIELDS = (
    "ri_user_time",
    "ri_system_time",
    "ri_pkg_idle_wkups",
    "ri_interrupt_wkups",
    "ri_pageins",
    "ri_wired_size",
    "ri_resident_size",
    "ri_phys_footprint",
    "ri_proc_start_abstime",
    "ri_proc_exit_abstime",
    "ri_child_user_time",
    "ri_child_system_time",
    "ri_child_pkg_idle_wkups",
    "ri_child_interrupt_wkups",
    "ri_child_pageins",
    "ri_child_elapsed_abstime",
    "ri_diskio_bytesread",
    "ri_diskio_byteswritten",
    "ri_cpu_time_qos_default",
    "ri_cpu_time_qos_maintenance",
    "ri_cpu_time_qos_background",
    "ri_cpu_time_qos_utility",
    "ri_cpu_time_qos_legacy",
    "ri_cpu_time_qos_user_initiated",
    "ri_cpu_time_qos_user_interactive",
    "ri_billed_system_time",
    "ri_serviced_system_time",
    "ri_logical_writes",
    "ri_lifetime_max_phys_footprint",
    "ri_instructions",
    "ri_cycles",
    "ri_billed_energy",
    "ri_serviced_energy",
    "ri_interval_max_phys_footprint",
    "ri_runnable_time",
)


class RusageInfoV4(ctypes.Structure):
    """``struct rusage_info_v4`` from ``<sys/resource.h>``: 16-byte uuid + 35 uint64 = 296."""

    _fields_ = [("ri_uuid", ctypes.c_uint8 * 16)] + [
        (name, ctypes.c_uint64) for name in _RUSAGE_V4_U64_FIELDS
    ]


def wired_limit_bytes(sysctl: Callable[[str], int | None]) -> int | None:
    """``iogpu.wired_limit_mb`` in bytes; ``None`` when unset (0) or unavailable."""
    mb = sysctl("iogpu.wired_limit_mb")
    if mb is None or mb <= 0:
        return None
    return mb * MiB


def device_cap(wired_limit: int | None, recommended_working_set: int | None) -> int | None:
    """The wired limit if the user set one, else MLX's recommended working set."""
    if wired_limit is not None and wired_limit > 0:
        return wired_limit
    if recommended_working_set is not None and recommended_working_set > 0:
        return recommended_working_set
    return None


def snapshot_from_vm_stats(
    vm: VMStatistics64,
    *,
    page_size: int,
    total_bytes: int,
    footprint_bytes: int,
    allocator_active: int,
    allocator_cache: int,
    device_cap_bytes: int | None,
    taken_at: float,
) -> MemorySnapshot:
    """Turn page counts into a snapshot (pure: tests feed a hand-filled struct)."""
    return MemorySnapshot(
        platform="macos",
        total_bytes=total_bytes,
        footprint_bytes=footprint_bytes,
        allocator_active_bytes=allocator_active,
        allocator_cache_bytes=allocator_cache,
        free_bytes=vm.free_count * page_size,
        inactive_bytes=vm.inactive_count * page_size,
        active_bytes=vm.active_count * page_size,
        wired_bytes=vm.wire_count * page_size,
        device_cap_bytes=device_cap_bytes,
        taken_at=taken_at,
        usage_source="phys_footprint",
    )


class _Darwin:
    """The ctypes calls, bound once."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.dylib", use_errno=True)
        self.libc = libc
        libc.mach_host_self.restype = ctypes.c_uint32
        libc.mach_host_self.argtypes = []
        libc.host_page_size.restype = ctypes.c_int
        libc.host_page_size.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_size_t)]
        libc.host_statistics64.restype = ctypes.c_int
        libc.host_statistics64.argtypes = [
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_uint32),
        ]
        libc.proc_pid_rusage.restype = ctypes.c_int
        libc.proc_pid_rusage.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        libc.sysctlbyname.restype = ctypes.c_int
        libc.sysctlbyname.argtypes = [
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_void_p,
            ctypes.c_size_t,
        ]
        self.host = libc.mach_host_self()
        size = ctypes.c_size_t(0)
        if libc.host_page_size(self.host, ctypes.byref(size)) != KERN_SUCCESS:
            raise OSError("host_page_size failed")
        self.page_size = int(size.value)
        self.pid = os.getpid()

    def vm_stats(self) -> VMStatistics64:
        vm = VMStatistics64()
        count = ctypes.c_uint32(HOST_VM_INFO64_COUNT)
        rc = self.libc.host_statistics64(
            self.host, HOST_VM_INFO64, ctypes.byref(vm), ctypes.byref(count)
        )
        if rc != KERN_SUCCESS:
            raise OSError(f"host_statistics64 failed: {rc}")
        return vm

    def phys_footprint(self) -> int:
        info = RusageInfoV4()
        if self.libc.proc_pid_rusage(self.pid, RUSAGE_INFO_V4, ctypes.byref(info)) != 0:
            raise OSError(ctypes.get_errno(), "proc_pid_rusage failed")
        return int(info.ri_phys_footprint)

    def sysctl_int(self, name: str) -> int | None:
        buf = ctypes.c_uint64(0)
        size = ctypes.c_size_t(ctypes.sizeof(buf))
        rc = self.libc.sysctlbyname(name.encode(), ctypes.byref(buf), ctypes.byref(size), None, 0)
        if rc != 0:
            return None
        # Integer sysctls may be 4 bytes; the buffer was zeroed, so little-endian reads work.
        return int(buf.value)


def _recommended_working_set() -> int | None:
    import mlx.core as mx

    info: dict[str, Any] = dict(mx.device_info())
    value = info.get("max_recommended_working_set_size")
    return int(value) if value else None


class MacOSProbe:
    """Reads macOS memory state (Darwin only; see the module docstring)."""

    def __init__(
        self,
        *,
        allocator: Callable[[], tuple[int, int]] | None = None,
        recommended_working_set: Callable[[], int | None] | None = None,
    ) -> None:
        self._darwin = _Darwin()
        self._allocator = allocator or mlx_allocator_bytes
        self._total = self._darwin.sysctl_int("hw.memsize") or 0
        # Fixed for the life of the process: read once.
        self._recommended = (recommended_working_set or _recommended_working_set)()

    def read(self) -> MemorySnapshot:
        d = self._darwin
        vm = d.vm_stats()
        footprint = d.phys_footprint()
        # The wired limit can be changed at runtime (sudo sysctl): read it every time.
        cap = device_cap(wired_limit_bytes(d.sysctl_int), self._recommended)
        active, cache = self._allocator()
        return snapshot_from_vm_stats(
            vm,
            page_size=d.page_size,
            total_bytes=self._total,
            footprint_bytes=footprint,
            allocator_active=active,
            allocator_cache=cache,
            device_cap_bytes=cap,
            taken_at=time.monotonic(),
        )
