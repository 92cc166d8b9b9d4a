"""MemoryGuard: the thread-safe, runtime-switchable facade the engine calls.

It owns a probe and the current policy (enabled, tier, custom ceiling); each ``check``
reads a fresh snapshot, computes the ceiling, decides, and remembers the decision for the
dashboard. The lock only guards policy and history: probe reads run outside it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from .ceiling import Ceiling, CeilingConfig, Tier, compute_ceiling
from .decision import AdmissionQuery, Decision, Outcome, decide, usage_bytes
from .errors import ProbeUnavailableError
from .probes.base import Probe
from .snapshot import MemorySnapshot

DISABLED_REASON = "memory guard disabled"


@dataclass(frozen=True)
class GuardState:
    """The policy in force: ``ceiling_bytes`` is set exactly when the tier is custom."""

    enabled: bool
    tier: Tier
    ceiling_bytes: int | None


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
    ) -> None:
        if history <= 0:
            raise ValueError("history must be positive")
        self._probe = probe
        self._config = config
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

    def check(self, query: AdmissionQuery, *, record: bool = True) -> Decision:
        """Snapshot, ceiling, decide, record. Disabled → ADMIT (numbers still filled in).

        A :class:`ProbeUnavailableError` from the probe passes through when enabled: the
        caller must not admit.

        ``record=False`` leaves the history and counts alone: for the engine's repeated
        questions (a request re-checked every step while it waits, a chunk tried at
        smaller sizes), which it records once with :meth:`record`.
        """
        state = self.state()
        try:
            snap = self._probe.read()
        except ProbeUnavailableError:
            if state.enabled:
                raise  # never admit blind: the engine refuses with "retry later"
            snap = None
        if snap is None:  # disabled: the user asked for no admission control
            decision = Decision(
                outcome=Outcome.ADMIT, reason=DISABLED_REASON, needed_bytes=0, limit_bytes=0,
                binding="unknown", usage_bytes=0, predicted_bytes=query.predicted_bytes,
                request_id=query.request_id, at=time.time(),
            )
            if record:
                self.record(decision)
            return decision
        ceiling = compute_ceiling(snap, state.tier, self._config, state.ceiling_bytes)
        if state.enabled:
            decision = dataclasses.replace(decide(snap, ceiling, query), at=time.time())
        else:
            usage = usage_bytes(snap)
            decision = Decision(
                outcome=Outcome.ADMIT,
                reason=DISABLED_REASON,
                needed_bytes=usage + query.committed_bytes + query.predicted_bytes,
                limit_bytes=ceiling.hard_bytes,
                binding=ceiling.binding,
                usage_bytes=usage,
                predicted_bytes=query.predicted_bytes,
                request_id=query.request_id,
                at=time.time(),
            )
        if record:
            self.record(decision)
        return decision

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
