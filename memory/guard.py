"""MemoryGuard: the thread-safe, runtime-switchable facade the engine calls.

It owns a probe and the current policy (enabled, tier, custom ceiling); each ``check``
reads a fresh snapshot, computes the ceiling, decides, and remembers the decision for the
dashboard. The lock only guards policy and history: probe reads run outside it.

Two rules keep a bad reading from becoming a final answer:

- **Hand back, then read again.** Before it lets an EVICT or a WAIT stand, and from time to
  time when the footprint holds much more than MLX counts, the guard asks the caller to
  hand memory back (``reclaim``: on the engine, ``mx.synchronize()`` + ``mx.clear_cache()``,
  which also returns CUDA's pool to the device) and decides again on a new reading.
- **Unknown is not "no".** A probe that fails, or a reading older than
  ``max_reading_age_s``, is read once more; if it is still bad the answer is WAIT with the
  reason, never REJECT: only a request that cannot fit even alone is refused for good.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._units import MiB
from .ceiling import Ceiling, CeilingConfig, Tier, compute_ceiling
from .decision import (
    CODE_GUARD_DISABLED,
    CODE_PROBE_FAILED,
    CODE_READING_STALE,
    AdmissionQuery,
    Decision,
    Outcome,
    decide,
    usage_bytes,
)
from .probes.base import Probe
from .snapshot import MemorySnapshot

DISABLED_REASON = "memory guard disabled"


@dataclass(frozen=True)
class GuardState:
    """The policy in force: ``ceiling_bytes`` is set exactly when the tier is custom."""

    enabled: bool
    tier: Tier
    ceiling_bytes: int | None


@dataclass(frozen=True)
class HandBackPolicy:
    """When memory MLX does not count (CUDA's pool) is worth handing back unasked: when it
    exceeds what the last hand-back left (the CUDA context, the interpreter) by
    ``margin_bytes``, at most every ``interval_s``."""

    margin_bytes: int = 256 * MiB
    interval_s: float = 1.0


@dataclass(frozen=True)
class _Reading:
    snapshot: MemorySnapshot | None
    code: str = ""  # CODE_PROBE_FAILED or CODE_READING_STALE when snapshot is None
    problem: str = ""


def _validated(state: GuardState) -> GuardState:
    if state.tier is Tier.CUSTOM:
        if state.ceiling_bytes is None or state.ceiling_bytes <= 0:
            raise ValueError("tier 'custom' needs a positive ceiling_bytes")
    elif state.ceiling_bytes is not None:
        raise ValueError(f"ceiling_bytes only applies to tier 'custom', not {state.tier.value!r}")
    return state


class MemoryGuard:
    """Thread-safe, runtime-switchable facade used by the engine."""

    def __init__(
        self,
        probe: Probe,
        *,
        enabled: bool = True,
        tier: Tier = Tier.BALANCED,
        custom_ceiling_bytes: int | None = None,
        config: CeilingConfig = CeilingConfig(),  # noqa: B008 (frozen, immutable default)
        history: int = 100,
        max_reading_age_s: float | None = None,
        hand_back: HandBackPolicy = HandBackPolicy(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if history <= 0:
            raise ValueError("history must be positive")
        self._probe = probe
        self._config = config
        self._max_age = max_reading_age_s
        self._hand_back = hand_back
        self._clock = clock
        self._untracked_floor: int | None = None
        self._last_hand_back = float("-inf")
        self._hand_backs = 0
        self._lock = threading.Lock()
        self._state = _validated(GuardState(enabled, Tier(tier), custom_ceiling_bytes))
        self._history: deque[Decision] = deque(maxlen=history)
        # Refusals and waits apart: one admit per prefill chunk would soon push them out.
        self._refusals: deque[Decision] = deque(maxlen=history)
        self._counts: dict[Outcome, int] = dict.fromkeys(Outcome, 0)

    def configure(
        self,
        *,
        enabled: bool | None = None,
        tier: Tier | None = None,
        ceiling_bytes: int | None = None,
    ) -> GuardState:
        """Change the policy atomically; unspecified fields keep their value.

        ``ceiling_bytes`` alone switches to the custom tier; switching to any other tier
        drops the custom ceiling. Raises ``ValueError`` (leaving the state unchanged) for
        a custom tier without a positive ceiling, or a ceiling with a non-custom tier.
        """
        with self._lock:
            cur = self._state
            new_tier = Tier(tier) if tier is not None else cur.tier
            if ceiling_bytes is not None and tier is None:
                new_tier = Tier.CUSTOM
            if ceiling_bytes is not None:
                new_ceiling: int | None = ceiling_bytes
            elif new_tier is Tier.CUSTOM:
                new_ceiling = cur.ceiling_bytes
            else:
                new_ceiling = None
            new = _validated(
                GuardState(cur.enabled if enabled is None else enabled, new_tier, new_ceiling)
            )
            self._state = new
            return new

    def state(self) -> GuardState:
        with self._lock:
            return self._state

    def snapshot(self) -> MemorySnapshot:
        return self._probe.read()

    def probe_status(self) -> str:
        """``"ok"``, ``"stale"`` or ``"unavailable"`` for a
        :class:`~memory.probes.resilient.ResilientProbe`; other probes raise instead."""
        status = getattr(self._probe, "status", None)
        return str(status()) if callable(status) else "ok"

    def ceiling(self, snapshot: MemorySnapshot | None = None) -> Ceiling:
        state = self.state()
        snap = snapshot if snapshot is not None else self._probe.read()
        return compute_ceiling(snap, state.tier, self._config, state.ceiling_bytes)

    def check(
        self,
        query: AdmissionQuery,
        *,
        record: bool = True,
        reclaim: Callable[[], None] | None = None,
    ) -> Decision:
        """Snapshot, ceiling, decide, record. Disabled → ADMIT (numbers still filled in).

        ``reclaim`` hands memory back (the engine passes ``mx.synchronize()`` +
        ``mx.clear_cache()``); the guard calls it when that could change the answer, then
        decides again on a fresh reading. ``record=False`` leaves the history and counts
        alone: for the engine's repeated questions (a request re-checked every step while
        it waits, a chunk tried at smaller sizes), which it records once with :meth:`record`.
        """
        state = self.state()
        reading = self._read()
        decision = self._decide(state, reading, query)
        if reclaim is not None and self._hand_back_helps(state, reading, decision, query):
            reclaim()
            with self._lock:
                self._hand_backs += 1
                self._last_hand_back = self._clock()
            reading = self._read()
            if reading.snapshot is not None:
                # What a hand-back leaves untracked is not reclaimable (CUDA context, RSS of
                # the interpreter): only growth beyond it counts from now on.
                with self._lock:
                    self._untracked_floor = reading.snapshot.untracked_bytes
            decision = self._decide(state, reading, query)
        if record:
            self.record(decision)
        return decision

    def _read(self) -> _Reading:
        """A fresh snapshot, or why there is none after a second try."""
        bad = _Reading(None)
        for _ in range(2):
            try:
                snap = self._probe.read()
            except Exception as exc:  # any probe failure: unknown, not "full"
                bad = _Reading(None, CODE_PROBE_FAILED, f"the memory probe failed ({exc!r})")
                continue
            age = self._clock() - snap.taken_at
            if self._max_age is not None and age > self._max_age:
                bad = _Reading(None, CODE_READING_STALE, f"the memory reading is {age:.1f}s old")
                continue
            with self._lock:  # memory returned late (CUDA trims its pool at a later sync)
                if self._untracked_floor is not None and snap.untracked_bytes < self._untracked_floor:
                    self._untracked_floor = snap.untracked_bytes
            return _Reading(snap)
        return bad

    def _decide(self, state: GuardState, reading: _Reading, query: AdmissionQuery) -> Decision:
        now = time.time()
        snap = reading.snapshot
        if snap is None:
            outcome = Outcome.ADMIT if not state.enabled else Outcome.WAIT
            what = DISABLED_REASON if not state.enabled else (
                "WAIT: cannot tell whether this fits, so it waits and reads again"
            )
            return Decision(
                outcome=outcome,
                reason=f"{what}: {reading.problem}.",
                needed_bytes=0,
                limit_bytes=0,
                binding="unknown",
                usage_bytes=0,
                predicted_bytes=query.predicted_bytes,
                code=CODE_GUARD_DISABLED if not state.enabled else reading.code,
                request_id=query.request_id,
                at=now,
            )
        ceiling = compute_ceiling(snap, state.tier, self._config, state.ceiling_bytes)
        if state.enabled:
            return dataclasses.replace(decide(snap, ceiling, query), at=now)
        usage = usage_bytes(snap)
        return Decision(
            outcome=Outcome.ADMIT,
            reason=DISABLED_REASON,
            needed_bytes=usage + query.committed_bytes + query.predicted_bytes,
            limit_bytes=ceiling.hard_bytes,
            binding=ceiling.binding,
            usage_bytes=usage,
            predicted_bytes=query.predicted_bytes,
            code=CODE_GUARD_DISABLED,
            request_id=query.request_id,
            at=now,
        )

    def untracked_excess_bytes(self, snapshot: MemorySnapshot) -> int:
        """Memory MLX does not count beyond what the last hand-back left (all of it before
        the first): what a hand-back may return on top of MLX's cache (CUDA's pool)."""
        with self._lock:
            floor = self._untracked_floor
        return max(0, snapshot.untracked_bytes - (floor if floor is not None else 0))

    def _hand_back_helps(
        self, state: GuardState, reading: _Reading, decision: Decision, query: AdmissionQuery
    ) -> bool:
        snap = reading.snapshot
        if not state.enabled or snap is None:
            return False
        excess = self.untracked_excess_bytes(snap)
        reclaimable = snap.allocator_cache_bytes + excess
        if decision.outcome is Outcome.EVICT:
            return reclaimable > 0  # cheaper than dropping prefix-cache entries
        if decision.outcome is Outcome.WAIT:
            return reclaimable > 0 and reclaimable >= decision.over_bytes - query.evictable_bytes
        with self._lock:
            due = self._clock() - self._last_hand_back >= self._hand_back.interval_s
        return due and excess > self._hand_back.margin_bytes

    @property
    def hand_backs(self) -> int:
        """How many times the guard had memory handed back before deciding."""
        with self._lock:
            return self._hand_backs

    def record(self, decision: Decision) -> None:
        with self._lock:
            self._history.append(decision)
            self._counts[decision.outcome] += 1
            if decision.outcome in (Outcome.WAIT, Outcome.REJECT):
                self._refusals.append(decision)

    def recent_decisions(self) -> list[Decision]:
        """Oldest first, at most ``history`` of them."""
        with self._lock:
            return list(self._history)

    def recent_refusals(self) -> list[Decision]:
        """The last WAIT and REJECT decisions, oldest first, however many admits came since."""
        with self._lock:
            return list(self._refusals)

    def counts(self) -> Mapping[Outcome, int]:
        """Decisions by outcome since start (every outcome present)."""
        with self._lock:
            return dict(self._counts)
