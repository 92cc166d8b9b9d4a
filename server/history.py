"""A bounded ring of 1 Hz samples, so the dashboard's chart survives a reload.

The sampler runs on the event loop and reads only what is already published: the engine's
stats (a frozen value swapped after each step) and the guard's snapshot and counts, the
same reads `/v1/memory` makes. It never calls into MLX or waits on the engine thread.
Counters are kept cumulative, so any window (tokens/s over 10 s, refusals over 5 min) is
the difference between now and the sample that starts it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("mlx_headroom.server")

PERIOD_S = 1.0
SIZE = 900  # 15 minutes at 1 Hz


@dataclass(frozen=True)
class Sample:
    at: float  # time.time()
    usage_bytes: int
    committed_bytes: int
    ceiling_bytes: int
    guard_enabled: bool
    prompt_tokens: int  # cumulative, from the engine
    generated_tokens: int
    waits: int  # cumulative guard decisions
    rejects: int


class History:
    """The last ``size`` samples, oldest first; ``read`` takes one sample of the live state."""

    def __init__(self, read: Callable[[], Sample], *, period_s: float = PERIOD_S,
                 size: int = SIZE) -> None:
        self.read = read
        self.period_s = period_s
        self._ring: deque[Sample] = deque(maxlen=size)
        self._task: asyncio.Task[None] | None = None

    def take(self) -> Sample:
        sample = self.read()
        self._ring.append(sample)
        return sample

    def since(self, after: float | None = None) -> list[Sample]:
        """Samples newer than ``after`` (all of them when None), oldest first."""
        samples = list(self._ring)
        if after is None:
            return samples
        start = bisect.bisect_right([s.at for s in samples], after)
        return samples[start:]

    def at_or_before(self, when: float) -> Sample | None:
        """The newest sample taken no later than ``when``: the start of a window."""
        found = None
        for sample in self._ring:
            if sample.at > when:
                break
            found = sample
        return found

    def oldest(self) -> Sample | None:
        return self._ring[0] if self._ring else None

    async def _run(self) -> None:
        failed = False
        while True:
            taken = time.time()
            try:
                self.take()
                failed = False
            except Exception:  # a failing probe must not end the history for good
                if not failed:
                    log.exception("memory history: taking a sample failed; retrying each second")
                failed = True
            await asyncio.sleep(max(self.next_due(taken) - time.time(), 0.0))

    def next_due(self, taken: float) -> float:
        """The next period boundary at least half a period after ``taken``: aligned, so the
        samples stay a period apart however long a read takes, and never a second sample
        just after the first when the loop's timer wakes a little before the boundary."""
        due = (taken // self.period_s + 1) * self.period_s
        return due + self.period_s if due - taken < self.period_s / 2 else due

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="memory-history")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
