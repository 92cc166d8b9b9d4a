"""One guard, several engines: each engine's view adds what the others have been promised.

Every loaded model has its own engine thread, and every engine asks the one guard before
it allocates. The probe reads the whole process, so what another engine has already
allocated (weights, KV segments) is in the reading. What is not in it yet is what another
engine was admitted for and is about to allocate: its new KV segment, the transient of the
prefill chunk it is running. :class:`SharedCommitments` keeps, per engine, the
``predicted_bytes`` of its latest admitted step, and :class:`GuardView` adds the other
engines' entries to ``committed_bytes`` of every question it asks. Checks are serialised
by one lock, so two engines never both spend the same room. An entry is replaced by the
engine's next question (the engine's idle upkeep asks once a second with nothing
predicted), so a finished step stops counting within about a second: a conservative lag.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from .decision import AdmissionQuery, Decision, Outcome
from .guard import MemoryGuard


class SharedCommitments:
    """Bytes each engine was admitted for and may not have allocated yet, by engine key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.check_lock = threading.Lock()  # one engine's question at a time
        self._pending: dict[str, int] = {}

    def others(self, key: str) -> int:
        with self._lock:
            return sum(v for k, v in self._pending.items() if k != key)

    def set(self, key: str, nbytes: int) -> None:
        with self._lock:
            self._pending[key] = nbytes

    def drop(self, key: str) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._pending)


class GuardView:
    """The guard as one engine sees it; everything but ``check`` is the guard's own."""

    def __init__(self, guard: MemoryGuard, shared: SharedCommitments, key: str) -> None:
        self._guard = guard
        self._shared = shared
        self.key = key

    def check(
        self,
        query: AdmissionQuery,
        *,
        record: bool = True,
        reclaim: Callable[[], None] | None = None,
    ) -> Decision:
        with self._shared.check_lock:
            others = self._shared.others(self.key)
            if others:
                query = dataclasses.replace(query, committed_bytes=query.committed_bytes + others)
            decision = self._guard.check(query, record=record, reclaim=reclaim)
            admitted = decision.outcome in (Outcome.ADMIT, Outcome.EVICT)
            self._shared.set(self.key, query.predicted_bytes if admitted else 0)
            return decision

    def __getattr__(self, name: str) -> Any:
        return getattr(self._guard, name)
