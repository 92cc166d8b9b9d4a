"""A fake Darwin libc for the macOS probe: the kernel's answers, and its failure modes.

It stands in for ``ctypes.CDLL("libc.dylib")`` and writes through the same pointers the
real calls do, so the probe's ctypes code runs unchanged on Linux. What it replays:

- ``host_statistics64(HOST_VM_INFO64)`` as macOS 27 answers it: fresh replies fill what
  the caller's count allows; once the rate limiter serves its cached copy, a reply larger
  than the caller's count comes back as -307 (``MIG_ARRAY_TOO_LARGE``), the first
  ``count`` integers copied and ``count`` set to what was needed (the MIG user stub's
  behaviour);
- a permanently failing call (``fail_rc``);
- stale counts: while ``rate_limited``, replies repeat the counts of the last fresh one
  (XNU's ``rate_limit_host_statistics``), whatever the machine does meanwhile;
- ``sysctlbyname``, which is never rate-limited: ``vm.page_free_count`` is always fresh.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memory.probes.macos import RusageInfoV4, VMStatistics64

# The kernel's numbers, written out here rather than taken from the code under test.
GiB = 1 << 30
KERN_FAILURE = 5
MIG_ARRAY_TOO_LARGE = -307
HOST_VM_INFO64 = 4
HOST_VM_INFO64_COUNT = 38  # sizeof(vm_statistics64) / sizeof(integer_t) before macOS 27


class _Fn:
    """A callable with the ``restype``/``argtypes`` attributes the probe sets."""

    def __init__(self, fn: Callable[..., int]) -> None:
        self.fn = fn
        self.restype: Any = None
        self.argtypes: Any = None
        self.calls = 0

    def __call__(self, *args: Any) -> int:
        self.calls += 1
        return self.fn(*args)


def _target(arg: Any) -> Any:
    """The ctypes object behind a pointer or a byref() argument."""
    return arg.contents if hasattr(arg, "contents") else arg._obj


def _address(arg: Any) -> int:
    if isinstance(arg, int):
        return arg
    if isinstance(arg, ctypes.c_void_p):
        return int(arg.value or 0)
    return ctypes.addressof(_target(arg))


@dataclass
class FakeDarwin:
    """The machine the fake libc describes. Page counts are in pages of ``page_size``."""

    page_size: int = 16384
    memsize: int = 64 * GiB
    free_pages: int = 1_000_000  # sysctl vm.page_free_count (fresh)
    speculative_pages: int = 50_000
    active_pages: int = 600_000
    inactive_pages: int = 500_000
    wire_pages: int = 200_000
    footprint: Callable[[], int] | int = 2 * GiB
    wired_limit_mb: int = 0
    kernel_count: int = HOST_VM_INFO64_COUNT  # integers in this kernel's vm_statistics64
    rate_limited: bool = False  # replies come from the cache: stale counts
    mig_after: int | None = None  # calls after which the cache answers (macOS 27's -307)
    fail_rc: int | None = None  # every host_statistics64 call fails with this
    fail_count: int = 0  # the count written back on failure (0: unchanged)
    fail_rusage: bool = False
    sysctl_vm_counts: bool = True  # False: an OS without vm.page_free_count
    _cache: VMStatistics64 | None = None
    vm_calls: list[tuple[int, int]] = field(default_factory=list)  # (count in, rc)

    def __post_init__(self) -> None:
        self.mach_host_self = _Fn(lambda: 1234)
        self.host_page_size = _Fn(self._host_page_size)
        self.host_statistics64 = _Fn(self._host_statistics64)
        self.proc_pid_rusage = _Fn(self._proc_pid_rusage)
        self.sysctlbyname = _Fn(self._sysctlbyname)

    # ---- the machine changes -------------------------------------------------------
    def allocate(self, nbytes: int) -> None:
        """This process takes `nbytes` from the free list (footprint and active grow)."""
        pages = nbytes // self.page_size
        self.free_pages -= pages
        self.active_pages += pages
        if isinstance(self.footprint, int):
            self.footprint += nbytes

    def current_footprint(self) -> int:
        return self.footprint() if callable(self.footprint) else self.footprint

    def _fresh(self) -> VMStatistics64:
        return VMStatistics64(
            free_count=self.free_pages + self.speculative_pages,
            active_count=self.active_pages,
            inactive_count=self.inactive_pages,
            wire_count=self.wire_pages,
            speculative_count=self.speculative_pages,
        )

    # ---- libc ------------------------------------------------------------------------
    def _host_page_size(self, host: int, out: Any) -> int:
        _target(out).value = self.page_size
        return 0

    def _host_statistics64(self, host: int, flavor: int, buf: Any, count_arg: Any) -> int:
        assert flavor == HOST_VM_INFO64
        count = _target(count_arg)
        asked = int(count.value)
        if self.fail_rc is not None:
            if self.fail_count:
                count.value = self.fail_count
            self.vm_calls.append((asked, self.fail_rc))
            return self.fail_rc
        cached = self.rate_limited or (self.mig_after is not None and len(self.vm_calls) >= self.mig_after)
        if not cached or self._cache is None:
            self._cache = self._fresh()
        reply = self._cache
        # Fresh replies fit the caller; the cached copy is the kernel's full struct.
        size = self.kernel_count if cached else min(asked, self.kernel_count)
        written = min(asked, size)
        data = (ctypes.c_int32 * max(size, HOST_VM_INFO64_COUNT))()
        ctypes.memmove(data, ctypes.addressof(reply), ctypes.sizeof(reply))
        for i in range(HOST_VM_INFO64_COUNT, size):
            data[i] = 0x5A5A5A5A  # fields this probe does not know
        ctypes.memmove(_address(buf), data, written * 4)
        count.value = size
        rc = MIG_ARRAY_TOO_LARGE if size > asked else 0
        self.vm_calls.append((asked, rc))
        return rc

    def _proc_pid_rusage(self, pid: int, flavor: int, buf: Any) -> int:
        if self.fail_rusage:
            return -1
        info = RusageInfoV4(ri_phys_footprint=self.current_footprint())
        ctypes.memmove(_address(buf), ctypes.addressof(info), ctypes.sizeof(info))
        return 0

    def _sysctlbyname(self, name: bytes, buf: Any, size_arg: Any, new: Any, newlen: int) -> int:
        values: dict[bytes, tuple[int, type[ctypes._SimpleCData]]] = {  # type: ignore[type-arg]
            b"hw.memsize": (self.memsize, ctypes.c_uint64),
            b"iogpu.wired_limit_mb": (self.wired_limit_mb, ctypes.c_uint32),
        }
        if self.sysctl_vm_counts:
            values[b"vm.page_free_count"] = (self.free_pages, ctypes.c_uint32)
            values[b"vm.page_speculative_count"] = (self.speculative_pages, ctypes.c_uint32)
        if name not in values:
            return -1
        value, ctype = values[name]
        raw = ctype(value)
        ctypes.memmove(_address(buf), ctypes.addressof(raw), ctypes.sizeof(raw))
        _target(size_arg).value = ctypes.sizeof(raw)
        return 0
