"""macOS probe: Mach VM page counts, the process's physical footprint, the GPU wired limit.

- ``host_statistics64(mach_host_self(), HOST_VM_INFO64, ...)`` gives page counts;
  ``host_page_size`` converts them to bytes. ``free_count`` already includes speculative
  pages (``vm_stat`` prints ``free_count - speculative_count`` as "Pages free").
- ``proc_pid_rusage(getpid(), RUSAGE_INFO_V4, &buf)`` gives ``ri_phys_footprint``, the number
  Activity Monitor and jetsam use. The buffer MUST be the full ``rusage_info_v4`` (296
  bytes): the kernel writes the whole struct, and a shorter buffer gets overrun.
- ``sysctl iogpu.wired_limit_mb`` (0 = the default) and MLX's
  ``max_recommended_working_set_size`` give the device cap: the wired limit if set,
  else the recommended working set. The wired limit can be changed while the server runs
  (``sudo sysctl``), so it is re-read with the VM statistics, at most once per interval.
- ``sysctl vm.page_free_count`` + ``vm.page_speculative_count`` give free pages fresh on
  every read: ``host_statistics64`` is rate-limited for third-party binaries (see
  :class:`MacOSProbe`) and, on macOS 27, answers -307 once it serves a cached copy (see
  :meth:`_Darwin.vm_stats`).

The ctypes structures and parsing functions are importable (and tested) on Linux; only
:meth:`MacOSProbe.read` needs Darwin.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ProbeError
from ..snapshot import MemorySnapshot
from .base import mlx_allocator_bytes

HOST_VM_INFO64 = 4
RUSAGE_INFO_V4 = 4
KERN_SUCCESS = 0
MIG_ARRAY_TOO_LARGE = -307  # the reply held more than the caller's count; count = needed
HOST_INFO_MAX = 1024  # <mach/host_info.h>: the largest reply any host_info flavour may send
MiB = 1024 * 1024

log = logging.getLogger("mlx_headroom.memory")


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
    free_bytes: int | None = None,
) -> MemorySnapshot:
    """Turn page counts into a snapshot (pure: tests feed a hand-filled struct).

    ``free_bytes`` overrides ``vm.free_count``: the probe reads free pages fresh through
    sysctl, while the struct may be a sample up to a second old."""
    return MemorySnapshot(
        platform="macos",
        total_bytes=total_bytes,
        footprint_bytes=footprint_bytes,
        allocator_active_bytes=allocator_active,
        allocator_cache_bytes=allocator_cache,
        free_bytes=vm.free_count * page_size if free_bytes is None else free_bytes,
        inactive_bytes=vm.inactive_count * page_size,
        active_bytes=vm.active_count * page_size,
        wired_bytes=vm.wire_count * page_size,
        device_cap_bytes=device_cap_bytes,
        taken_at=taken_at,
        usage_source="phys_footprint",
    )


class HostStatisticsError(ProbeError):
    def __init__(self, rc: int, count: int) -> None:
        super().__init__(f"host_statistics64(HOST_VM_INFO64) failed: {rc} (count {count})")
        self.rc = rc
        self.count = count


class _Darwin:
    """The ctypes calls, bound once. ``libc`` is injectable: tests pass a fake one that
    replays the kernel's failure modes (see tests/memory/fake_darwin.py).

    Out-parameters are passed as ``ctypes.pointer`` (not ``byref``) so that a fake libc
    written in Python can write through them exactly as the kernel would.
    """

    def __init__(self, libc: Any = None) -> None:
        if libc is None:
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
        if libc.host_page_size(self.host, ctypes.pointer(size)) != KERN_SUCCESS:
            raise ProbeError("host_page_size failed")
        self.page_size = int(size.value)
        self.pid = os.getpid()
        # The count this kernel answers HOST_VM_INFO64 with; starts at the struct we know
        # and follows what the kernel reports after MIG_ARRAY_TOO_LARGE.
        self.vm_count = HOST_VM_INFO64_COUNT

    def vm_stats(self) -> VMStatistics64:
        """``host_statistics64(HOST_VM_INFO64)``, robust to a kernel with a larger struct.

        macOS 27 answers with more than the 38 integers of ``vm_statistics64`` once its
        rate limiter serves a cached copy: the MIG stub then returns -307
        (``MIG_ARRAY_TOO_LARGE``) and sets ``count`` to the size it needed. The buffer is
        ``HOST_INFO_MAX`` integers (the largest any flavour may answer), the first call
        passes the count we know (a larger one makes newer kernels log "count is larger
        than expected"), and on -307 it retries once with the kernel's count and keeps
        using it. The fields we read sit in the first 38 integers of every revision.
        """
        buf = (ctypes.c_int32 * HOST_INFO_MAX)()
        count = ctypes.c_uint32(self.vm_count)
        rc = self.libc.host_statistics64(
            self.host, HOST_VM_INFO64, ctypes.addressof(buf), ctypes.pointer(count)
        )
        if rc == MIG_ARRAY_TOO_LARGE and self.vm_count < count.value <= HOST_INFO_MAX:
            self.vm_count = int(count.value)
            count = ctypes.c_uint32(self.vm_count)
            rc = self.libc.host_statistics64(
                self.host, HOST_VM_INFO64, ctypes.addressof(buf), ctypes.pointer(count)
            )
        if rc != KERN_SUCCESS:
            raise HostStatisticsError(rc, int(count.value))
        vm = VMStatistics64()
        n = min(int(count.value), HOST_VM_INFO64_COUNT)
        ctypes.memmove(ctypes.addressof(vm), ctypes.addressof(buf), n * 4)
        return vm

    def phys_footprint(self) -> int:
        info = RusageInfoV4()
        if self.libc.proc_pid_rusage(self.pid, RUSAGE_INFO_V4, ctypes.addressof(info)) != 0:
            raise ProbeError(ctypes.get_errno(), "proc_pid_rusage failed")
        return int(info.ri_phys_footprint)

    def sysctl_int(self, name: str) -> int | None:
        buf = ctypes.c_uint64(0)
        size = ctypes.c_size_t(ctypes.sizeof(buf))
        rc = self.libc.sysctlbyname(
            name.encode(), ctypes.addressof(buf), ctypes.pointer(size), None, 0
        )
        if rc != 0:
            return None
        # Integer sysctls may be 4 bytes; the buffer was zeroed, so little-endian reads work.
        return int(buf.value)

    def free_pages(self) -> int | None:
        """Free pages as ``vm_stat`` counts them (free + speculative), read through
        sysctl: fresh on every call, unlike ``host_statistics64``. ``None`` if absent."""
        free = self.sysctl_int("vm.page_free_count")
        speculative = self.sysctl_int("vm.page_speculative_count")
        if free is None or speculative is None:
            return None
        return free + speculative


def _recommended_working_set() -> int | None:
    import mlx.core as mx

    # The GPU's figures: the default device may be the CPU (mx.set_default_device).
    info: dict[str, Any] = dict(mx.device_info(mx.gpu))
    value = info.get("max_recommended_working_set_size")
    return int(value) if value else None


@dataclass(frozen=True)
class _VMSample:
    """One ``host_statistics64`` reading and the footprint read at the same moment."""

    vm: VMStatistics64
    footprint_bytes: int
    taken_at: float


class MacOSProbe:
    """Reads macOS memory state (Darwin only; see the module docstring).

    VM statistics are rate-limited for binaries that are not Apple's: 2–10 fresh replies
    per second, shared by every process on the machine, the rest a cached copy up to ~1 s
    old (``rate_limit_host_statistics`` in XNU's ``osfmk/kern/host.c``). Asking more
    often only returns stale counts, so the probe samples them at most once per
    ``vm_interval_s`` and pairs each sample with the footprint read at that moment. Free
    pages, which our own allocations consume, come fresh from sysctl on every read; the GPU
    wired limit is re-read with each VM sample (a change shows within ``vm_interval_s``); when
    sysctl lacks them, the sample's free count is moved by how much our footprint has
    grown since, so memory we allocated is not counted both as ours and as free.

    A failed VM reading keeps the last good sample for ``vm_max_age_s``; after that (or
    before any sample) inactive and active count as zero: the dynamic ceiling is then
    footprint + free, lower than the truth, never higher.
    """

    def __init__(
        self,
        *,
        allocator: Callable[[], tuple[int, int]] | None = None,
        recommended_working_set: Callable[[], int | None] | None = None,
        libc: Any = None,
        clock: Callable[[], float] = time.monotonic,
        vm_interval_s: float = 1.0,
        vm_max_age_s: float = 30.0,
    ) -> None:
        self._darwin = _Darwin(libc)
        self._allocator = allocator or mlx_allocator_bytes
        self._clock = clock
        self._vm_interval_s = vm_interval_s
        self._vm_max_age_s = vm_max_age_s
        self._total = self._darwin.sysctl_int("hw.memsize") or 0
        # Fixed for the life of the process: read once.
        self._recommended = (recommended_working_set or _recommended_working_set)()
        self._lock = threading.Lock()  # the engine and the HTTP side both read
        self._sample: _VMSample | None = None
        self._wired_limit = wired_limit_bytes(self._darwin.sysctl_int)
        self._last_attempt = -math.inf
        self.vm_failures = 0  # consecutive failed VM readings (0 = the last one worked)

    def read(self) -> MemorySnapshot:
        d = self._darwin
        now = self._clock()
        footprint = d.phys_footprint()
        sample = self._vm_sample(now, footprint)
        free_pages = d.free_pages()
        if free_pages is not None:
            free_bytes = free_pages * d.page_size
        elif sample is not None:
            grown = footprint - sample.footprint_bytes
            free_bytes = max(sample.vm.free_count * d.page_size - grown, 0)
        else:
            raise ProbeError("no free-memory figure: host_statistics64 and sysctl both failed")
        cap = device_cap(self._wired_limit, self._recommended)
        active, cache = self._allocator()
        return snapshot_from_vm_stats(
            sample.vm if sample is not None else VMStatistics64(),  # none: inactive = active = 0
            page_size=d.page_size,
            total_bytes=self._total,
            footprint_bytes=footprint,
            allocator_active=active,
            allocator_cache=cache,
            device_cap_bytes=cap,
            taken_at=now,
            free_bytes=free_bytes,
        )

    def _vm_sample(self, now: float, footprint: int) -> _VMSample | None:
        """The current VM sample, refreshed at most once per interval; None when there is
        no sample younger than ``vm_max_age_s``."""
        with self._lock:
            if now - self._last_attempt >= self._vm_interval_s:
                self._last_attempt = now
                # changed at runtime with `sudo sysctl iogpu.wired_limit_mb=...`
                self._wired_limit = wired_limit_bytes(self._darwin.sysctl_int)
                try:
                    vm = self._darwin.vm_stats()
                except ProbeError as exc:
                    self.vm_failures += 1
                    if self.vm_failures == 1 or self.vm_failures % 60 == 0:
                        log.warning("memory probe: %s; %d failure(s) in a row, using the last "
                                    "good VM statistics", exc, self.vm_failures)
                else:
                    if self.vm_failures:
                        log.info("memory probe: host_statistics64 works again after %d "
                                 "failure(s)", self.vm_failures)
                    self.vm_failures = 0
                    self._sample = _VMSample(vm, footprint, now)
            sample = self._sample
        if sample is None or now - sample.taken_at > self._vm_max_age_s:
            return None
        return sample
