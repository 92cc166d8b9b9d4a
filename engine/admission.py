"""Turns the engine's state into the memory guard's questions, and its answers into values.

The guard (memory/) knows bytes, ceilings and policy; this module knows what the engine
holds: the KV store's reservations, the prompts being prefilled, and the prefix cache.

Accounting. Each request reserves its own prompt + max_tokens in the KV store, rounded
up to whole blocks (`KVStore.reservation_bytes`), and the store allocates it when the
request is admitted: decoding writes into memory that already exists, so it can never
outgrow what was admitted. What admission asks the guard for is the memory the store
must newly take from the device (`KVStore.growth_bytes`: zero when a segment has the
free blocks, else a new segment), plus the prefill chunk's transients.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from engine.kv import KVStore
from engine.sequence import Sequence
from memory import (
    AdmissionQuery,
    Decision,
    MemoryGuard,
    ModelGeometry,
    Outcome,
    TransientTracker,
    estimate_prefill,
)


@dataclass(frozen=True)
class ChunkPlan:
    tokens: int
    predicted_bytes: int
    decision: Decision


class Admission:
    def __init__(
        self,
        guard: MemoryGuard,
        geometry: ModelGeometry,
        store: KVStore,
        *,
        backend: str,
        min_chunk_tokens: int = 32,
        tracker: TransientTracker | None = None,
    ) -> None:
        self.guard = guard
        self.geometry = geometry
        self.store = store
        self.backend = backend
        self.min_chunk_tokens = min_chunk_tokens
        self.tracker = tracker or TransientTracker()
        self.checks = 0
        self.check_seconds = 0.0  # engine-thread time spent asking the guard: its cost

    def _ask(self, query: AdmissionQuery) -> Decision:
        started = time.perf_counter()
        decision = self.guard.check(query, record=False)
        self.check_seconds += time.perf_counter() - started
        self.checks += 1
        return decision

    def reservation_bytes(self, seqs: Iterable[Sequence]) -> int:
        """Each sequence's own prompt + max_tokens in whole blocks; never rows × longest."""
        return sum(self.store.reservation_bytes(s.final_len) for s in seqs)

    def growth_bytes(self, seq: Sequence, *, exact: bool) -> int:
        return self.store.growth_bytes(seq.final_len, seq.shared, exact=exact)

    def committed_bytes(self, admitted: list[Sequence], allocated_kv: int) -> int:
        return max(self.reservation_bytes(admitted) - allocated_kv, 0)

    def preflight(
        self,
        seq: Sequence,
        admitted: list[Sequence],
        allocated_kv: int,
        evictable: int,
    ) -> tuple[Decision, bool]:
        """Can the request's whole reservation be had, with room left for prefill chunks?

        Returns the decision and whether the store must size a new segment exactly to
        the request (when a full default-size segment would not fit but the request does).

        Admission leaves headroom for the largest full-size chunk among the admitted
        requests and this one; without it, reservations could fill the ceiling and leave
        no room for anyone's next chunk. When that does not fit but a floor-sized chunk
        would, and nothing else is in flight, the request is admitted anyway: its chunks
        will shrink rather than be refused.
        """
        before = self.reservation_bytes(admitted)

        def ask(chunk: int, exact: bool = False) -> Decision:
            return self._ask(
                AdmissionQuery(
                    predicted_bytes=self.growth_bytes(seq, exact=exact) + chunk,
                    committed_bytes=max(before - allocated_kv, 0),
                    evictable_bytes=evictable,
                    releasable_bytes=max(before, allocated_kv),
                    request_id=seq.request_id,
                )
            )

        full = max(
            (self.full_chunk_prediction(s) for s in [*admitted, seq] if s.remaining_prefill),
            default=0,
        )
        go = (Outcome.ADMIT, Outcome.EVICT)
        decision = ask(full)
        exact = False
        smaller = self.growth_bytes(seq, exact=True) < self.growth_bytes(seq, exact=False)
        if decision.outcome not in go and smaller:
            tight = ask(full, exact=True)
            if tight.outcome in go or decision.outcome is Outcome.REJECT:
                decision, exact = tight, True
        if decision.outcome is Outcome.REJECT and not admitted:
            floor = self._chunk_prediction(seq, max(min(self.min_chunk_tokens, seq.remaining_prefill), 1))
            fallback = ask(floor, exact=True)
            if fallback.outcome in go:
                return fallback, True
        return decision, exact

    def full_chunk_prediction(self, seq: Sequence) -> int:
        """A full-size chunk (joining the batch copies nothing: no join term)."""
        tokens = max(min(seq.chunk_tokens, seq.remaining_prefill), 1)
        return self._chunk_prediction(seq, tokens)

    def plan_chunk(
        self,
        seq: Sequence,
        admitted: list[Sequence],
        allocated_kv: int,
        evictable: int,
        max_tokens: int | None = None,
    ) -> ChunkPlan:
        """Ask before the chunk; when it does not fit, halve it down to the floor first."""
        committed = self.committed_bytes(admitted, allocated_kv)
        others = self.reservation_bytes([s for s in admitted if s is not seq])
        releasable = max(others, allocated_kv - self.reservation_bytes([seq]))
        tokens = min(seq.chunk_tokens, seq.remaining_prefill, max_tokens or seq.chunk_tokens)
        while True:
            predicted = self._chunk_prediction(seq, tokens)
            decision = self._ask(
                AdmissionQuery(
                    predicted_bytes=predicted,
                    committed_bytes=committed,
                    evictable_bytes=evictable,
                    releasable_bytes=releasable,
                    request_id=seq.request_id,
                )
            )
            if decision.outcome in (Outcome.ADMIT, Outcome.EVICT):
                return ChunkPlan(tokens, predicted, decision)
            if tokens <= self.min_chunk_tokens:
                return ChunkPlan(tokens, predicted, decision)
            tokens = max(tokens // 2, self.min_chunk_tokens)

    def observe_chunk(self, tokens: int, peak_delta_bytes: int) -> None:
        self.tracker.observe(tokens, peak_delta_bytes)

    def _chunk_prediction(self, seq: Sequence, tokens: int) -> int:
        estimate = estimate_prefill(
            self.geometry,
            chunk_tokens=max(tokens, 1),
            context_tokens=seq.processed,
            batch=1,
            backend=self.backend,
        )
        return self.tracker.predict(max(tokens, 1), estimate.total_bytes)
