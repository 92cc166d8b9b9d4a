"""Turns the engine's state into the memory guard's questions, and its answers into values.

The guard (memory/) knows bytes, ceilings and policy; this module knows what the engine
holds: the KV store's reservations, the prompts being prefilled, and the prefix cache.

Accounting. Each request reserves its own prompt + max_tokens in the KV store, rounded
up to whole blocks (`KVStore.reservation_bytes`), and the store allocates it when the
request is admitted: decoding writes into memory that already exists, so it can never
outgrow what was admitted. What admission asks the guard for is the memory the store
must newly take from the device (`KVStore.growth_bytes`: zero when a segment has the
free blocks, else a new segment), plus the prefill chunk's transients, plus, where decode
gathers each layer's K/V (`engine.kv.decode_transient`), what the batch's decode steps
gather with the request among their rows.

Memory truth. The guard counts what the device counts, MLX's buffer cache and CUDA's pool
included; this module owns the two MLX calls that keep that honest: handing memory back
(`mx.synchronize()` then `mx.clear_cache()`, which the guard asks for before a WAIT or an
EVICT stands) and MLX's cache limit, set after every decision to the room it leaves, so
cached buffers can never push the footprint past the ceiling. Each question also says what
the request needs alone on an idle server (`solo_bytes` over `baseline_bytes`, the idle
footprint measured at start): only if that cannot fit is a refusal final.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

import mlx.core as mx

from engine.kv import KVStore
from engine.kv.decode_transient import decode_gather_bytes
from engine.kv.prefill import needs_array_mask
from engine.prompt_scoring import scoring_bytes
from engine.sequence import Sequence
from memory import (
    AdmissionQuery,
    Decision,
    MemoryGuard,
    ModelGeometry,
    Outcome,
    TransientTracker,
    cache_limit_bytes,
    estimate_prefill,
)
from memory.decision import CODE_GUARD_DISABLED

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
        store: KVStore,
        *,
        backend: str,
        min_chunk_tokens: int = 32,
        tracker: TransientTracker | None = None,
        weight_bytes: int = 0,
    ) -> None:
        self.guard = guard
        self.geometry = geometry
        self.store = store
        self.backend = backend
        self.min_chunk_tokens = min_chunk_tokens
        self.tracker = tracker or TransientTracker()
        self.checks = 0
        self.check_seconds = 0.0  # engine-thread time spent asking the guard: its cost
        self._chunks: deque[ChunkSample] = deque(maxlen=RECENT_CHUNKS)
        self._chunks_view: tuple[ChunkSample, ...] = ()  # rebuilt per chunk, not per step
        self.peak_bytes = 0  # MLX's peak before the latest reset (chunks reset it)
        # MLX's own default (32 MiB on the CPU, the memory limit on CUDA): never raised above.
        self.default_cache_limit = mx.set_cache_limit(0)  # returns the limit it replaces
        mx.set_cache_limit(self.default_cache_limit)
        self.cache_limit_bytes = mx.set_cache_limit(self.default_cache_limit)  # read back
        self.baseline_bytes = self._idle_footprint(weight_bytes)
        self._last_upkeep = time.monotonic()

    def _idle_footprint(self, weight_bytes: int) -> int:
        """What the idle server holds (weights, runtime, CUDA context): the floor under any
        request, measured once at start, after handing back what loading left cached."""
        self.hand_back()
        try:
            footprint = self.guard.snapshot().footprint_bytes
        except Exception:  # no reading: the weights are the floor we know
            footprint = 0
        return max(weight_bytes, footprint)

    def hand_back(self) -> None:
        """Give back what MLX holds but does not use: wait for queued work (on CUDA a
        synchronize is when CUDA's pool returns freed memory to the device), free MLX's
        buffer cache (on CUDA, into that pool), and synchronize again so the pool returns
        those buffers too before the guard reads again."""
        mx.synchronize()
        mx.clear_cache()
        mx.synchronize()

    def _ask(self, query: AdmissionQuery) -> Decision:
        started = time.perf_counter()
        decision = self.guard.check(query, record=False, reclaim=self.hand_back)
        self._follow(decision)
        self.check_seconds += time.perf_counter() - started
        self.checks += 1
        return decision

    def _follow(self, decision: Decision) -> None:
        """Set MLX's cache limit to the room `decision` leaves (MLX's default when the guard
        is off), and read it back from MLX."""
        if decision.code == CODE_GUARD_DISABLED:
            target = self.default_cache_limit
        else:
            room = cache_limit_bytes(decision)
            if room is None:
                return
            target = min(room, self.default_cache_limit)
        if target != self.cache_limit_bytes:
            mx.set_cache_limit(target)
            self.cache_limit_bytes = mx.set_cache_limit(target)

    def follow_ceiling(self, committed: int) -> int:
        """After the policy changed (PUT /v1/memory-guard): the cache limit from the new
        ceiling, with what in-flight requests have committed. Returns the limit MLX holds."""
        self._follow(
            self.guard.check(
                AdmissionQuery(predicted_bytes=0, committed_bytes=committed,
                               baseline_bytes=self.baseline_bytes),
                record=False,
            )
        )
        return self.cache_limit_bytes

    UPKEEP_INTERVAL_S = 1.0

    def upkeep_due(self) -> bool:
        return time.monotonic() - self._last_upkeep >= self.UPKEEP_INTERVAL_S

    def upkeep(self, committed: int) -> Decision:
        """Once a second, whatever runs (decode-only stretches ask nothing otherwise): read
        memory, let the guard have memory handed back if the footprint holds much more than
        MLX counts or is over the ceiling, and set the cache limit to the room left."""
        self._last_upkeep = time.monotonic()
        return self._ask(AdmissionQuery(predicted_bytes=0, committed_bytes=committed,
                                        baseline_bytes=self.baseline_bytes))

    def reset_peak(self) -> None:
        """Reset MLX's peak (chunks measure their own), keeping the lifetime peak."""
        self.peak_bytes = max(self.peak_bytes, mx.get_peak_memory())
        mx.reset_peak_memory()

    def lifetime_peak_bytes(self) -> int:
        return max(self.peak_bytes, mx.get_peak_memory())

    def solo_bytes(self, seq: Sequence, tokens: int) -> int:
        """What `seq` needs alone on an idle server, with chunks of `tokens`: its own
        reservation and one chunk (joining the batch copies nothing)."""
        return self.reservation_bytes([seq]) + self.chunk_prediction(seq, tokens)

    def reservation_bytes(self, seqs: Iterable[Sequence]) -> int:
        """Each sequence's own prompt + max_tokens, as the store holds them together: in the
        paged store whole blocks each, never rows × longest; in mlx-lm's own caches what
        each row's caches hold, plus the left padding their merged batch adds."""
        return self.store.rows_reservation_bytes(s.final_len for s in seqs)

    def decode_transient_bytes(self, seqs: Sequence_[Sequence]) -> int:
        """What the batch's decode steps gather beside the store once these rows decode
        together (`engine.kv.decode_transient`); none for a lone row, which is read in place,
        nor in mlx-lm's own caches, which attend the arrays they hold."""
        if len(seqs) < 2 or not isinstance(self.store, KVStore):
            return 0
        return decode_gather_bytes(self.store, (s.final_len for s in seqs))

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
        *,
        reusable: bool = False,
    ) -> tuple[Decision, bool, bool]:
        """Can the request's whole reservation be had, with room left for prefill chunks?

        Returns the decision, whether the store must size a new segment exactly to the
        request (when a full default-size segment would not fit but the request does), and
        whether the reservation is to take blocks the prefix cache holds in a live segment
        instead (`reusable`: the engine found such a segment). A new segment is preferred
        when it fits: the cache keeps its blocks; else the cached blocks go before a segment
        is sized exactly, or anyone waits.

        Admission leaves headroom for the largest full-size chunk among the admitted
        requests and this one; without it, reservations could fill the ceiling and leave
        no room for anyone's next chunk. When that does not fit but a floor-sized chunk
        would, and nothing else is in flight, the request is admitted anyway: its chunks
        will shrink rather than be refused. It is refused for good only if, even with
        floor-sized chunks, it could not fit alone on an idle server.
        """
        before = self.reservation_bytes(admitted)
        floor = max(min(self.min_chunk_tokens, seq.remaining_prefill), 1)
        solo = self.solo_bytes(seq, floor)

        gathered = self.decode_transient_bytes([*admitted, seq])

        def ask(chunk: int, exact: bool = False, in_place: bool = False) -> Decision:
            growth = 0 if in_place else self.growth_bytes(seq, exact=exact)
            return self._ask(
                AdmissionQuery(
                    predicted_bytes=growth + chunk + gathered,
                    committed_bytes=max(before - allocated_kv, 0),
                    evictable_bytes=evictable,
                    releasable_bytes=max(before, allocated_kv),
                    request_id=seq.request_id,
                    solo_bytes=solo,
                    baseline_bytes=self.baseline_bytes,
                )
            )

        full = max(
            (self.full_chunk_prediction(s) for s in [*admitted, seq] if s.remaining_prefill),
            default=0,
        )
        go = (Outcome.ADMIT, Outcome.EVICT)
        decision = ask(full)
        if decision.outcome is not Outcome.ADMIT and reusable:
            reuse = ask(full, in_place=True)
            if reuse.outcome in go:
                return reuse, False, True
        exact = False
        smaller = self.growth_bytes(seq, exact=True) < self.growth_bytes(seq, exact=False)
        if decision.outcome not in go and smaller:
            tight = ask(full, exact=True)
            if tight.outcome in go or decision.outcome is Outcome.REJECT:
                decision, exact = tight, True
        if decision.outcome not in go and not admitted:
            fallback = ask(self.chunk_prediction(seq, floor), exact=True)
            if fallback.outcome in go:
                return fallback, True, False
        return decision, exact, False

    def headroom_bytes(self, tokens: int) -> int:
        """A full prefill chunk of `tokens` at the start of a prompt, as predicted now: the
        room the prefix cache leaves free under the ceiling."""
        estimate = estimate_prefill(self.geometry, chunk_tokens=max(tokens, 1), context_tokens=0,
                                    batch=1, backend=self.backend)
        return self.tracker.predict(max(tokens, 1), estimate.total_bytes)

    def full_chunk_prediction(self, seq: Sequence) -> int:
        """A full-size chunk (joining the batch copies nothing: no join term)."""
        tokens = max(min(seq.chunk_tokens, seq.remaining_prefill), 1)
        return self.chunk_prediction(seq, tokens)

    def plan_chunk(
        self,
        seq: Sequence,
        admitted: list[Sequence],
        allocated_kv: int,
        evictable: int,
        max_tokens: int | None = None,
        batch: Sequence_[tuple[Sequence, int]] = (),
    ) -> ChunkPlan:
        """Ask before the chunk; when it does not fit, halve it down to the floor first.

        `batch` holds the chunks already gathered for this step's prefill call: the
        question is asked for the whole batch with this chunk added (`batch_prediction`),
        since they run as one call. The plan returns that prediction.
        """
        committed = self.committed_bytes(admitted, allocated_kv)
        gathered = self.decode_transient_bytes(admitted if seq in admitted else [*admitted, seq])
        others = self.reservation_bytes([s for s in admitted if s is not seq])
        releasable = max(others, allocated_kv - self.reservation_bytes([seq]))
        tokens = min(seq.chunk_tokens, seq.remaining_prefill, max_tokens or seq.chunk_tokens)
        while True:
            predicted = self.batch_prediction([*batch, (seq, tokens)]) if batch else \
                self.chunk_prediction(seq, tokens)
            decision = self._ask(
                AdmissionQuery(
                    predicted_bytes=predicted + gathered,
                    committed_bytes=committed,
                    evictable_bytes=evictable,
                    releasable_bytes=releasable,
                    request_id=seq.request_id,
                    solo_bytes=self.solo_bytes(seq, tokens),
                    baseline_bytes=self.baseline_bytes,
                )
            )
            if decision.outcome in (Outcome.ADMIT, Outcome.EVICT):
                return ChunkPlan(tokens, predicted, decision)
            if tokens <= self.min_chunk_tokens:
                return ChunkPlan(tokens, predicted, decision)
            tokens = max(tokens // 2, self.min_chunk_tokens)

    def observe_chunk(self, tokens: int, peak_delta_bytes: int, predicted_bytes: int = 0) -> None:
        self.tracker.observe(tokens, peak_delta_bytes)
        self._chunks.append(ChunkSample(time.time(), tokens, predicted_bytes, peak_delta_bytes,
                                        self.tracker.ewma_bytes_per_token))
        self._chunks_view = tuple(self._chunks)

    def recent_chunks(self) -> tuple[ChunkSample, ...]:
        """The last chunks, oldest first."""
        return self._chunks_view

    def batch_prediction(self, chunks: Sequence_[tuple[Sequence, int]]) -> int:
        """Chunks run as one right-padded call: B rows × the longest chunk, attending up to
        the furthest row's end; never less than the chunks' own predictions summed."""
        if len(chunks) == 1:
            return self.chunk_prediction(*chunks[0])
        own = sum(self.chunk_prediction(s, n) for s, n in chunks)
        width = max(max(n, 1) for _, n in chunks)
        end = max(s.processed + n for s, n in chunks)
        ragged = needs_array_mask([s.processed for s, _ in chunks], [n for _, n in chunks])
        keys = self.store.key_lengths.call_keys(width, end, len(chunks), ragged=ragged)
        estimate = estimate_prefill(
            self.geometry, chunk_tokens=width, context_tokens=max(keys - width, 0),
            batch=len(chunks), backend=self.backend, masked=keys > end or ragged,
        )
        return max(own, self.tracker.predict(width * len(chunks), estimate.total_bytes))

    def _keys(self, queries: int, end: int, rows: int = 1) -> int:
        """The keys a causal prefill call ending at `end` attends: padded where the store
        pads them (`engine.kv.buckets.KeyLengths`)."""
        return self.store.key_lengths.keys(queries, end, rows)

    def chunk_prediction(self, seq: Sequence, tokens: int) -> int:
        """The chunk's transient alone (no join), as the tracker predicts it now."""
        tokens = max(tokens, 1)
        keys = self._keys(tokens, seq.processed + tokens)
        estimate = estimate_prefill(
            self.geometry,
            chunk_tokens=tokens,
            context_tokens=keys - tokens,
            batch=1,
            backend=self.backend,
            masked=keys > seq.processed + tokens,
        )
        scoring = 0
        if seq.scores_prompt:  # its chunk's logits are evaluated and scored
            scoring = scoring_bytes(tokens, self.geometry.vocab_size, self.geometry.dtype_bytes,
                                    seq.request.prompt_logprobs or 0)
        return self.tracker.predict(tokens, estimate.total_bytes) + scoring
