"""Linux probe: ``/proc/meminfo``, the process's resident set, and the cgroup memory limit.

Mapping onto :class:`MemorySnapshot` (chosen so the ceiling's dynamic formula
``footprint + free + inactive + active × ratio`` means the same thing as on macOS):

- ``free_bytes`` = MemFree, capped at ``memory.max − memory.current`` under a cgroup limit;
- ``inactive_bytes`` / ``active_bytes`` = Inactive(file) / Active(file): the page cache the
  kernel can drop for us. Anonymous pages of other processes are not reclaimable without
  swap, so they are deliberately left out;
- ``wired_bytes`` = Unevictable (which includes Mlocked);
- ``footprint_bytes`` = this process's RSS from ``/proc/self/statm``;
- ``device_cap_bytes`` = the cgroup limit (v2 ``memory.max``, or v1
  ``memory.limit_in_bytes``), ``None`` when unlimited.

Every path is relative to an injectable ``root`` so tests replay recorded files.
The cgroup directory is resolved once; the files are reopened on every read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..snapshot import MemorySnapshot
from .base import mlx_allocator_bytes

# cgroup v1 reports "no limit" as a huge page-aligned number (e.g. 9223372036854771712).
_V1_UNLIMITED_THRESHOLD = 1 << 60


# The fields the snapshot uses; the probe looks up only these.
MEMINFO_FIELDS = (
    "MemTotal",
    "MemFree",
    "MemAvailable",
    "Active(file)",
    "Inactive(file)",
    "Unevictable",
    "Mlocked",
)


def _meminfo_value(rest: str) -> int:
    parts = rest.split()
    value = int(parts[0])
    return value * 1024 if len(parts) > 1 and parts[1] == "kB" else value


def parse_meminfo(text: str, fields: Iterable[str] | None = None) -> dict[str, int]:
    """Parse ``/proc/meminfo`` into bytes by field name (values in kB are converted).

    With ``fields``, only those are looked up, by string search: this runs before every
    prefill chunk, and parsing all ~50 lines in Python took most of the probe's budget.
    """
    out: dict[str, int] = {}
    if fields is None:
        for line in text.splitlines():
            name, sep, rest = line.partition(":")
            if sep and rest.strip():
                try:
                    out[name.strip()] = _meminfo_value(rest)
                except ValueError:
                    continue
        return out
    text = "\n" + text
    for name in fields:
        key = "\n" + name + ":"
        i = text.find(key)
        if i < 0:
            continue
        start = i + len(key)
        end = text.find("\n", start)
        out[name] = _meminfo_value(text[start : end if end >= 0 else len(text)])
    return out


def _read(path: str) -> str:
    """Read a small kernel file, opened fresh (unbuffered binary: about half the cost of a
    text-mode open, which matters at three or four files per probe read)."""
    with open(path, "rb", buffering=0) as f:
        return f.read().decode()


def parse_statm_rss(text: str, page_size: int) -> int:
    """Resident set size in bytes from ``/proc/self/statm`` (second field, in pages)."""
    return int(text.split()[1]) * page_size


@dataclass(frozen=True)
class CgroupPaths:
    """Where this process's cgroup memory files live (resolved once per probe)."""

    version: int  # 1 or 2
    limit_path: str
    usage_path: str


def parse_proc_self_cgroup(text: str) -> tuple[str | None, str | None]:
    """Return ``(v2_path, v1_memory_path)`` from ``/proc/self/cgroup``.

    v2 lines look like ``0::/path``; the v1 memory controller like ``4:memory:/path``.
    """
    v2: str | None = None
    v1: str | None = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def parse_limit(text: str) -> int | None:
    """Parse a cgroup limit file: ``max`` (v2) or a huge number (v1) mean unlimited."""
    value = text.strip()
    if value == "max" or value == "":
        return None
    n = int(value)
    if n >= _V1_UNLIMITED_THRESHOLD:
        return None
    return n


def resolve_cgroup(root: str) -> CgroupPaths | None:
    """Find the memory cgroup files for this process under ``root``.

    Prefers v2. Inside a container the path named in ``/proc/self/cgroup`` often does not
    exist under the mounted ``/sys/fs/cgroup`` (the namespace root *is* our cgroup), so the
    mount root is tried next.
    """
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            v2, v1 = parse_proc_self_cgroup(f.read())
    except OSError:
        return None
    base = os.path.join(root, "sys/fs/cgroup")
    if v2 is not None:
        for d in (os.path.join(base, v2.lstrip("/")), base):
            if os.path.exists(os.path.join(d, "memory.max")):
                return CgroupPaths(
                    2, os.path.join(d, "memory.max"), os.path.join(d, "memory.current")
                )
    if v1 is not None:
        mbase = os.path.join(base, "memory")
        for d in (os.path.join(mbase, v1.lstrip("/")), mbase):
            if os.path.exists(os.path.join(d, "memory.limit_in_bytes")):
                return CgroupPaths(
                    1,
                    os.path.join(d, "memory.limit_in_bytes"),
                    os.path.join(d, "memory.usage_in_bytes"),
                )
    return None


def snapshot_from_linux(
    meminfo: dict[str, int],
    *,
    rss_bytes: int,
    cgroup_limit: int | None,
    cgroup_usage: int | None,
    allocator_active: int,
    allocator_cache: int,
    taken_at: float,
) -> MemorySnapshot:
    """Build a snapshot from parsed values (pure: the unit tests call this directly)."""
    free = meminfo.get("MemFree", 0)
    if cgroup_limit is not None:
        room = max(0, cgroup_limit - (cgroup_usage or 0))
        free = min(free, room)
    return MemorySnapshot(
        platform="linux",
        total_bytes=meminfo.get("MemTotal", 0),
        footprint_bytes=rss_bytes,
        allocator_active_bytes=allocator_active,
        allocator_cache_bytes=allocator_cache,
        free_bytes=free,
        inactive_bytes=meminfo.get("Inactive(file)", 0),
        active_bytes=meminfo.get("Active(file)", 0),
        wired_bytes=meminfo.get("Unevictable", meminfo.get("Mlocked", 0)),
        device_cap_bytes=cgroup_limit,
        taken_at=taken_at,
        usage_source="rss",
    )


class LinuxProbe:
    """Reads Linux memory state; see the module docstring for the field mapping."""

    def __init__(
        self,
        root: str = "/",
        *,
        allocator: Callable[[], tuple[int, int]] | None = None,
        page_size: int | None = None,
    ) -> None:
        self._root = root
        self._allocator = allocator or mlx_allocator_bytes
        self._page_size = page_size or os.sysconf("SC_PAGE_SIZE")
        self._meminfo = os.path.join(root, "proc/meminfo")
        self._statm = os.path.join(root, "proc/self/statm")
        self._cgroup = resolve_cgroup(root)

    @property
    def cgroup(self) -> CgroupPaths | None:
        return self._cgroup

    def read(self) -> MemorySnapshot:
        meminfo = parse_meminfo(_read(self._meminfo), MEMINFO_FIELDS)
        rss = parse_statm_rss(_read(self._statm), self._page_size)
        limit: int | None = None
        usage: int | None = None
        if self._cgroup is not None:
            try:
                limit = parse_limit(_read(self._cgroup.limit_path))
                if limit is not None:
                    usage = int(_read(self._cgroup.usage_path).strip())
            except (OSError, ValueError):
                limit, usage = None, None
        active, cache = self._allocator()
        return snapshot_from_linux(
            meminfo,
            rss_bytes=rss,
            cgroup_limit=limit,
            cgroup_usage=usage,
            allocator_active=active,
            allocator_cache=cache,
            taken_at=time.monotonic(),
        )
