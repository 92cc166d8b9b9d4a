from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from memtest_helpers import GiB, KiB

from memory.probes.linux import (
    LinuxProbe,
    parse_limit,
    parse_meminfo,
    parse_proc_self_cgroup,
    parse_statm_rss,
)

MEMINFO = """\
MemTotal:       32768000 kB
MemFree:        20000000 kB
MemAvailable:   26000000 kB
Buffers:          100000 kB
Cached:          5000000 kB
Active:          6000000 kB
Inactive:        4000000 kB
Active(anon):    2000000 kB
Inactive(anon):  1000000 kB
Active(file):    4000000 kB
Inactive(file):  3000000 kB
Unevictable:       10484 kB
Mlocked:            9420 kB
HugePages_Total:       0
"""
PAGE = 4096


def fake_alloc() -> tuple[int, int]:
    return 3 * GiB, 1 * GiB


def write_root(
    tmp: Path,
    *,
    cgroup: str = "0::/user.slice/app.scope\n",
    v2: dict[str, str] | None = None,
    v2_dir: str = "user.slice/app.scope",
    v1: dict[str, str] | None = None,
    v1_dir: str = "",
) -> Path:
    (tmp / "proc/self").mkdir(parents=True)
    (tmp / "proc/meminfo").write_text(MEMINFO)
    (tmp / "proc/self/statm").write_text("765 25000 411 5 0 123 0\n")
    (tmp / "proc/self/cgroup").write_text(cgroup)
    for files, base in (
        (v2, tmp / "sys/fs/cgroup" / v2_dir),
        (v1, tmp / "sys/fs/cgroup/memory" / v1_dir),
    ):
        if files is not None:
            base.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (base / name).write_text(text)
    return tmp


def test_parse_meminfo_converts_kb_and_keeps_unitless() -> None:
    info = parse_meminfo(MEMINFO)
    assert info["MemTotal"] == 32768000 * KiB
    assert info["Inactive(file)"] == 3000000 * KiB
    assert info["HugePages_Total"] == 0


def test_parse_statm_and_limits() -> None:
    assert parse_statm_rss("765 439 411 5 0 123 0", 4096) == 439 * 4096
    assert parse_limit("max\n") is None
    assert parse_limit("9223372036854771712\n") is None  # cgroup v1 "unlimited"
    assert parse_limit("8589934592\n") == 8 * GiB


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0::/a/b\n", ("/a/b", None)),
        ("4:memory:/docker/x\n0::/\n", ("/", "/docker/x")),
        ("3:cpu,memory:/k\n", (None, "/k")),
        ("", (None, None)),
    ],
)
def test_parse_proc_self_cgroup(text: str, expected: tuple[str | None, str | None]) -> None:
    assert parse_proc_self_cgroup(text) == expected


@pytest.mark.parametrize(
    ("layout", "cap", "free"),
    [
        # v2 with a limit: free is capped at max - current (8 GiB - 5 GiB).
        ({"v2": {"memory.max": str(8 * GiB), "memory.current": str(5 * GiB)}}, 8 * GiB, 3 * GiB),
        # v2 unlimited: MemFree, no cap.
        ({"v2": {"memory.max": "max\n", "memory.current": "123"}}, None, 20000000 * KiB),
        # limit larger than MemFree leaves MemFree alone.
        (
            {"v2": {"memory.max": str(400 * GiB), "memory.current": str(1 * GiB)}},
            400 * GiB,
            20000000 * KiB,
        ),
        # in a container the named path is absent; the mount root is our cgroup.
        (
            {"v2": {"memory.max": str(4 * GiB), "memory.current": str(1 * GiB)}, "v2_dir": ""},
            4 * GiB,
            3 * GiB,
        ),
        # cgroup v1 (hybrid hierarchy), limited and "unlimited".
        (
            {
                "cgroup": "4:memory:/docker/abc\n0::/\n",
                "v1": {
                    "memory.limit_in_bytes": str(6 * GiB),
                    "memory.usage_in_bytes": str(2 * GiB),
                },
            },
            6 * GiB,
            4 * GiB,
        ),
        (
            {
                "cgroup": "4:memory:/docker/abc\n0::/\n",
                "v1": {
                    "memory.limit_in_bytes": "9223372036854771712",
                    "memory.usage_in_bytes": "1",
                },
            },
            None,
            20000000 * KiB,
        ),
        # no cgroup files at all.
        ({}, None, 20000000 * KiB),
    ],
)
def test_linux_probe_with_recorded_files(
    tmp_path: Path, layout: dict[str, object], cap: int | None, free: int
) -> None:
    root = write_root(tmp_path, **layout)  # type: ignore[arg-type]
    snap = LinuxProbe(root=str(root), allocator=fake_alloc, page_size=PAGE).read()
    assert snap.platform == "linux"
    assert snap.total_bytes == 32768000 * KiB
    assert snap.footprint_bytes == 25000 * PAGE
    assert (snap.allocator_active_bytes, snap.allocator_cache_bytes) == (3 * GiB, 1 * GiB)
    assert snap.inactive_bytes == 3000000 * KiB  # Inactive(file)
    assert snap.active_bytes == 4000000 * KiB  # Active(file)
    assert snap.wired_bytes == 10484 * KiB  # Unevictable
    assert snap.device_cap_bytes == cap
    assert snap.free_bytes == free


def test_linux_probe_rereads_files(tmp_path: Path) -> None:
    root = write_root(tmp_path, v2={"memory.max": str(8 * GiB), "memory.current": str(5 * GiB)})
    probe = LinuxProbe(root=str(root), allocator=fake_alloc, page_size=PAGE)
    assert probe.read().free_bytes == 3 * GiB
    (root / "sys/fs/cgroup/user.slice/app.scope/memory.current").write_text(str(7 * GiB))
    assert probe.read().free_bytes == 1 * GiB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")
def test_real_linux_probe_is_cheap() -> None:
    probe = LinuxProbe()
    probe.read()
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        snap = probe.read()
    per_read = (time.perf_counter() - start) / n
    assert snap.total_bytes > 0 and snap.footprint_bytes > 0
    assert per_read < 1e-3, f"{per_read * 1e6:.0f} µs per read"


def test_parse_meminfo_selected_fields_matches_full_parse() -> None:
    full = parse_meminfo(MEMINFO)
    some = parse_meminfo(MEMINFO, ("MemTotal", "Active(file)", "Inactive(file)", "Missing"))
    assert some == {k: full[k] for k in ("MemTotal", "Active(file)", "Inactive(file)")}
    # "Active(file)" must not match inside "Inactive(file)", nor the first line be missed.
    assert parse_meminfo("Inactive(file): 7 kB\nActive(file): 3 kB", ("Active(file)",)) == {
        "Active(file)": 3 * KiB
    }
