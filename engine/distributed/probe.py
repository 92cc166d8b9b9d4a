"""Memory across the group: every rank's reading, and the one admission decides on.

Each step the ranks `all_gather` their own snapshot (see `lockstep`); rank 0's guard reads
through a `GroupProbe`, which answers with the *tightest* rank's snapshot: the one with
the least room under the ceiling (the policy is the group's, applied to each rank's own
device). Rank 0's own reading is always fresh (it is read here, so a hand-back on rank 0
counts at once); the others' are at most one step old.

`RankExtraBytes` is the injection the tests use to make one rank, and only that one, look
fuller than it is (`MLX_HEADROOM_TP_EXTRA_BYTES="1=3000000000"`): it adds bytes to that
rank's footprint, as memory held by something else in the same process would.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memory import MemorySnapshot
from memory.probes.base import Probe

EXTRA_BYTES_ENV = "MLX_HEADROOM_TP_EXTRA_BYTES"


@dataclass(frozen=True)
class RankReading:
    rank: int
    snapshot: MemorySnapshot
    headroom_bytes: int  # the ceiling's hard bytes less the footprint, under the group's policy


def snapshot_to_json(snap: MemorySnapshot) -> dict[str, Any]:
    return dataclasses.asdict(snap)


def snapshot_from_json(data: dict[str, Any]) -> MemorySnapshot:
    # The sender's monotonic clock means nothing here: the reading is as old as the step.
    return MemorySnapshot(**(data | {"taken_at": time.monotonic()}))


class RankExtraBytes:
    """A probe that adds `extra` bytes to another probe's footprint (a test injection)."""

    def __init__(self, inner: Probe, extra: int) -> None:
        self.inner = inner
        self.extra = extra

    def read(self) -> MemorySnapshot:
        snap = self.inner.read()
        return dataclasses.replace(snap, footprint_bytes=snap.footprint_bytes + self.extra)


def injected_extra_bytes(rank: int, environ: dict[str, str] | None = None) -> int:
    """Bytes `MLX_HEADROOM_TP_EXTRA_BYTES` ("rank=bytes[,rank=bytes]") adds to this rank."""
    spec = (environ if environ is not None else dict(os.environ)).get(EXTRA_BYTES_ENV, "")
    for part in filter(None, (p.strip() for p in spec.split(","))):
        who, _, amount = part.partition("=")
        if int(who) == rank:
            return int(amount)
    return 0


def rank_probe(inner: Probe, rank: int) -> Probe:
    extra = injected_extra_bytes(rank)
    return RankExtraBytes(inner, extra) if extra else inner


class GroupProbe:
    """Rank 0's probe: its own fresh reading against the others' latest; the tightest wins."""

    def __init__(self, local: Probe, size: int) -> None:
        self.local = local
        self.size = size
        self._others: dict[int, MemorySnapshot] = {}
        self._lock = threading.Lock()
        # headroom under the group's policy; set once the guard exists (it owns the policy)
        self.headroom: Callable[[MemorySnapshot], int] = lambda s: -s.footprint_bytes

    def update(self, snapshots: dict[int, MemorySnapshot]) -> None:
        with self._lock:
            self._others = {r: s for r, s in snapshots.items() if r != 0}

    def readings(self) -> list[RankReading]:
        """Every rank's latest reading, rank order (rank 0 read now)."""
        mine = self.local.read()
        with self._lock:
            others = dict(self._others)
        snaps = {0: mine, **others}
        return [RankReading(r, s, self.headroom(s)) for r, s in sorted(snaps.items())]

    def binding_rank(self, readings: list[RankReading]) -> int:
        return min(readings, key=lambda r: (r.headroom_bytes, r.rank)).rank

    def read(self) -> MemorySnapshot:
        readings = self.readings()
        tightest = self.binding_rank(readings)
        return next(r.snapshot for r in readings if r.rank == tightest)
