"""Turns the engine's state into the memory guard's questions, and its answers into values.

The guard (memory/) knows bytes, ceilings and policy; this module knows what the engine
holds: the decode batch, the caches of prompts being prefilled, and the prefix cache.

Accounting. The decode batch is a left-padded `BatchKVCache`, so its KV grows to
rows × the longest row's final length; admitting a request *commits* that growth, and
what is committed but not yet allocated is passed to the guard as `committed_bytes`, so
decoding can never outgrow what was admitted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.sequence import Sequence
from memory import (
    AdmissionQuery,
    Decision,
    MemoryGuard,
    ModelGeometry,
    Outcome,
    TransientTracker,
    estimate_prefill,
    kv_cache_bytes,
)

RECENT_CHUNKS = 32


@dataclass(frozen=True)
class ChunkSample:
    """One prefill chunk: what the guard was told it would take, and what it took.

    ``predicted_bytes`` is the chunk's own transient prediction (static estimate corrected
    by the tracker, with its margin), made before the chunk ran; ``measured_bytes`` is the
    peak above active memory while it ran. Their ratio says whether the guard is cautious.
    """

    at: float
    tokens: int
    predicted_bytes: int
    measured_bytes: int
    ewma_bytes_per_token: float | None


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
        *,
        backend: str,
        min_chunk_tokens: int = 32,
        tracker: TransientTracker | None = None,
    ) -> None:
        self.guard = guard
        self.geometry = geometry
        self.backend = backend
        self.min_chunk_tokens = min_chunk_tokens
        self.tracker = tracker or TransientTracker()
        self.checks = 0
        self.check_seconds = 0.0  # engine-thread time spent asking the guard: its cost
        self._chunks: deque[ChunkSample] = deque(maxlen=RECENT_CHUNKS)
        self._chunks_view: tuple[ChunkSample, ...] = ()  # rebuilt per chunk, not per step

    def _ask(self, query: AdmissionQuery) -> Decision:
        started = time.perf_counter()
        decision = self.guard.check(query, record=False)
        self.check_seconds += time.perf_counter() - started
        self.checks += 1
        return decision

    def reservation_bytes(self, seqs: Iterable[Sequence]) -> int:
        """KV the decode batch reaches if every admitted sequence runs to max_tokens,
        plus one layer's copy for the 256-token growth step (MLX grows by concatenation)."""
        finals = [s.final_len for s in seqs]
        if not finals:
            return 0
        full = kv_cache_bytes(self.geometry, max(finals), batch=len(finals))
        return full + full // max(self.geometry.num_layers, 1)

    def committed_bytes(self, admitted: list[Sequence], allocated_kv: int) -> int:
        return max(self.reservation_bytes(admitted) - allocated_kv, 0)

    def preflight(
        self,
        seq: Sequence,
        admitted: list[Sequence],
        allocated_kv: int,
        evictable: int,
    ) -> Decision:
        """Can the request's whole reservation be had, with room left for prefill chunks?

        Admission leaves headroom for the largest full-size chunk among the admitted
        requests and this one; without it, reservations could fill the ceiling and leave
        no room for anyone's next chunk. When that does not fit but a floor-sized chunk
        would, and nothing else is in flight, the request is admitted anyway: its chunks
        will shrink rather than be refused.
        """
        before = self.reservation_bytes(admitted)
        growth = self.reservation_bytes([*admitted, seq]) - before

        def ask(chunk: int) -> Decision:
            return self._ask(
                AdmissionQuery(
                    predicted_bytes=growth + chunk,
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
        decision = ask(full)
        if decision.outcome is Outcome.REJECT and not admitted:
            floor = self.chunk_prediction(seq, max(min(self.min_chunk_tokens, seq.remaining_prefill), 1))
            fallback = ask(floor)
            if fallback.outcome in (Outcome.ADMIT, Outcome.EVICT):
                return fallback
        return decision

    def full_chunk_prediction(self, seq: Sequence) -> int:
        """A full-size chunk; for the last one, plus the copy of the prompt's KV at the join."""
        tokens = max(min(seq.chunk_tokens, seq.remaining_prefill), 1)
        join = kv_cache_bytes(self.geometry, seq.prompt_len) if tokens >= seq.remaining_prefill else 0
        return self.chunk_prediction(seq, tokens) + join

    def plan_chunk(
        self,
        seq: Sequence,
        admitted: list[Sequence],
        allocated_kv: int,
        evictable: int,
        batch_kv_bytes: int = 0,
        max_tokens: int | None = None,
    ) -> ChunkPlan:
        """Ask before the chunk; when it does not fit, halve it down to the floor first.

        The last chunk is followed, in the same step, by the join: the prompt's KV is copied
        into the batch (`BatchKVCache.merge`, then `extend`, one layer at a time), so for a
        moment the prompt's KV exists twice and one layer of the batch three times.
        """
        committed = self.committed_bytes(admitted, allocated_kv)
        releasable = max(self.reservation_bytes([s for s in admitted if s is not seq]), 0)
        tokens = min(seq.chunk_tokens, seq.remaining_prefill, max_tokens or seq.chunk_tokens)
        while True:
            predicted = self.chunk_prediction(seq, tokens)
            if tokens >= seq.remaining_prefill:
                predicted += self.join_transient_bytes(seq, batch_kv_bytes)
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

    def join_transient_bytes(self, seq: Sequence, batch_kv_bytes: int) -> int:
        layers = max(self.geometry.num_layers, 1)
        return kv_cache_bytes(self.geometry, seq.prompt_len) + 2 * batch_kv_bytes // layers

    def observe_chunk(self, tokens: int, peak_delta_bytes: int, predicted_bytes: int = 0) -> None:
        self.tracker.observe(tokens, peak_delta_bytes)
        self._chunks.append(ChunkSample(time.time(), tokens, predicted_bytes, peak_delta_bytes,
                                        self.tracker.ewma_bytes_per_token))
        self._chunks_view = tuple(self._chunks)

    def recent_chunks(self) -> tuple[ChunkSample, ...]:
        """The last chunks, oldest first."""
        return self._chunks_view

    def chunk_prediction(self, seq: Sequence, tokens: int) -> int:
        """The chunk's transient alone (no join), as the tracker predicts it now."""
        estimate = estimate_prefill(
            self.geometry,
            chunk_tokens=max(tokens, 1),
            context_tokens=seq.processed,
            batch=1,
            backend=self.backend,
        )
        return self.tracker.predict(max(tokens, 1), estimate.total_bytes)
