"""Small factories shared by the memory tests (not a conftest: test dirs have no packages)."""

from __future__ import annotations

from typing import Any

from memory import MemorySnapshot

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def snap(**overrides: Any) -> MemorySnapshot:
    """A 64 GiB machine, 10 GiB own footprint, plenty free; override any field."""
    fields: dict[str, Any] = {
        "platform": "allocator",
        "total_bytes": 64 * GiB,
        "footprint_bytes": 10 * GiB,
        "allocator_active_bytes": 10 * GiB,
        "allocator_cache_bytes": 0,
        "free_bytes": 30 * GiB,
        "inactive_bytes": 4 * GiB,
        "active_bytes": 8 * GiB,
        "wired_bytes": 2 * GiB,
        "device_cap_bytes": None,
        "taken_at": 0.0,
    }
    fields.update(overrides)
    return MemorySnapshot(**fields)


class FixedProbe:
    """A probe returning a fixed (replaceable) snapshot."""

    def __init__(self, snapshot: MemorySnapshot) -> None:
        self.snapshot = snapshot
        self.reads = 0

    def read(self) -> MemorySnapshot:
        self.reads += 1
        return self.snapshot
