"""Admission as a value: given a snapshot, a ceiling and a query, say what to do and why.

``decide`` is pure. Usage is the process footprint as the device counts it, MLX's buffer
cache and (on CUDA) its pool included: that is what the device runs out of. Memory the
engine can hand back (``mx.synchronize()`` + ``mx.clear_cache()``) is handed back by the
guard *before* it accepts an EVICT or a WAIT, and the snapshot is read again (see
:mod:`memory.guard`), so it is never counted against a request that could have had it.

The step needs ``usage + committed + predicted``; then, in order:

- it fits under the hard ceiling → ADMIT;
- it fits once part of the prefix cache is evicted → EVICT exactly the excess;
- it could not fit even alone on an idle server, under the *fixed* ceiling (static, custom
  or device; never the dynamic one, which falls whenever something holds memory for a
  while) → REJECT, with a reason that says what the user can change. Only this is final;
- otherwise it would fit once memory comes back → WAIT, and read again.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ._units import format_bytes as fb
from .ceiling import Ceiling, Tier
from .snapshot import MemorySnapshot

CODE_WAITING = "waiting_for_memory"
CODE_PREFILL_EXCEEDED = "prefill_memory_exceeded"
CODE_PROMPT_EXCEEDS_CEILING = "prompt_exceeds_memory_ceiling"
CODE_PROBE_FAILED = "memory_probe_failed"
CODE_READING_STALE = "memory_reading_stale"
CODE_GUARD_DISABLED = "memory_guard_disabled"


class Outcome(str, Enum):
    ADMIT = "admit"
    EVICT = "evict"
    WAIT = "wait"
    REJECT = "reject"


@dataclass(frozen=True)
class AdmissionQuery:
    """What one step asks for, in bytes (all non-negative).

    ``solo_bytes`` is what the request needs on an idle server (its own reservation and its
    smallest chunk, on top of ``baseline_bytes``, the idle server's own footprint: weights
    and runtime). ``None`` means the step's ``predicted_bytes``.
    """

    predicted_bytes: int  # what this step needs on top of current usage
    committed_bytes: int = 0  # promised to admitted in-flight requests, not yet allocated
    evictable_bytes: int = 0  # prefix-cache bytes that could be freed now
    releasable_bytes: int = 0  # held or committed by in-flight requests: freed when they finish
    request_id: str | None = None
    solo_bytes: int | None = None
    baseline_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("predicted_bytes", "committed_bytes", "evictable_bytes", "releasable_bytes",
                     "baseline_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative")
        if self.solo_bytes is not None and self.solo_bytes < 0:
            raise ValueError("solo_bytes must be non-negative")

    @property
    def alone_bytes(self) -> int:
        """What the server's footprint would be with only this request in it."""
        solo = self.predicted_bytes if self.solo_bytes is None else self.solo_bytes
        return self.baseline_bytes + solo


@dataclass(frozen=True)
class Decision:
    """The outcome, the numbers behind it, and a sentence a user can act on.

    For REJECT, ``needed_bytes`` and ``limit_bytes`` are the request alone on an idle server
    against the fixed ceiling: the numbers that make the refusal final.
    """

    outcome: Outcome
    reason: str
    needed_bytes: int  # usage + committed + predicted
    limit_bytes: int  # the hard ceiling
    binding: str
    usage_bytes: int
    predicted_bytes: int
    bytes_to_free: int = 0  # for EVICT
    code: str = ""  # for REJECT and WAIT
    request_id: str | None = None
    at: float = 0.0  # time.time(), stamped by MemoryGuard (decide itself is pure)
    cache_bytes: int = 0  # MLX's buffer cache, part of usage_bytes

    @property
    def over_bytes(self) -> int:
        return max(0, self.needed_bytes - self.limit_bytes)


def usage_bytes(snapshot: MemorySnapshot) -> int:
    """The footprint as the device counts it: MLX's cache and CUDA's pool included."""
    return snapshot.footprint_bytes


def _raise_hint(tier: Tier) -> str:
    if tier is Tier.CUSTOM:
        return "raise the custom ceiling (it is also capped by the device limit)"
    if tier is Tier.AGGRESSIVE:
        return "raise the ceiling (a custom ceiling)"
    return "raise the ceiling (tier 'aggressive' or a custom ceiling)"


def decide(snapshot: MemorySnapshot, ceiling: Ceiling, query: AdmissionQuery) -> Decision:
    """Decide one admission (pure: same inputs, same Decision)."""
    usage = usage_bytes(snapshot)
    committed = query.committed_bytes
    predicted = query.predicted_bytes
    need = usage + committed + predicted
    hard = ceiling.hard_bytes
    head = (
        f"this step needs {fb(predicted)} on top of {fb(usage)} in use "
        f"({fb(usage + committed)} with {fb(committed)} committed); "
        f"the {ceiling.describe()}"
    )

    def make(outcome: Outcome, reason: str, *, to_free: int = 0, code: str = "") -> Decision:
        return Decision(
            outcome=outcome,
            reason=f"{outcome.name}: {head}. {reason}",
            needed_bytes=need,
            limit_bytes=hard,
            binding=ceiling.binding,
            usage_bytes=usage,
            predicted_bytes=predicted,
            bytes_to_free=to_free,
            code=code,
            request_id=query.request_id,
            cache_bytes=snapshot.allocator_cache_bytes,
        )

    if need <= hard:
        return make(Outcome.ADMIT, f"It fits with {fb(hard - need)} to spare.")
    over = need - hard
    if over <= query.evictable_bytes:
        return make(
            Outcome.EVICT,
            f"It is {fb(over)} over: evict {fb(over)} of prefix cache "
            f"(of {fb(query.evictable_bytes)} evictable) and clear MLX's buffer cache, then run.",
            to_free=over,
        )
    alone, fixed = query.alone_bytes, ceiling.fixed_bytes
    if alone > fixed:
        solo = alone - query.baseline_bytes
        code = CODE_PROMPT_EXCEEDS_CEILING if solo > fixed else CODE_PREFILL_EXCEEDED
        return Decision(
            outcome=Outcome.REJECT,
            reason=(
                f"REJECT: {head}. Even alone on an idle server it would need {fb(solo)} on top "
                f"of {fb(query.baseline_bytes)} (weights and runtime), {fb(alone - fixed)} more "
                f"than the {ceiling.fixed_binding} ceiling of {fb(fixed)}: shorten the prompt, "
                f"lower max_tokens, or {_raise_hint(ceiling.tier)}."
            ),
            needed_bytes=alone,
            limit_bytes=fixed,
            binding=ceiling.fixed_binding,
            usage_bytes=usage,
            predicted_bytes=predicted,
            code=code,
            request_id=query.request_id,
            cache_bytes=snapshot.allocator_cache_bytes,
        )
    return make(
        Outcome.WAIT,
        f"It is {fb(over)} over, and evicting {fb(query.evictable_bytes)} of prefix cache is not "
        f"enough; alone on an idle server it needs {fb(alone)} of the {ceiling.fixed_binding} "
        f"ceiling of {fb(fixed)}, so it waits for memory to come back (in-flight requests hold "
        f"{fb(query.releasable_bytes)}).",
        code=CODE_WAITING,
    )


def cache_limit_bytes(decision: Decision) -> int | None:
    """How much MLX may keep in its buffer cache after this decision, so that cached
    buffers cannot push the footprint past the ceiling: the ceiling less everything else
    the decision counts (for a WAIT, without the step that waits). ``None`` when the
    decision says nothing about the room now (a REJECT, an unreadable probe, a disabled
    guard)."""
    if decision.outcome is Outcome.REJECT or decision.code in (
        CODE_PROBE_FAILED, CODE_READING_STALE, CODE_GUARD_DISABLED
    ):
        return None
    others = decision.needed_bytes - decision.cache_bytes
    if decision.outcome is Outcome.WAIT:
        others -= decision.predicted_bytes
    return max(0, decision.limit_bytes - others)
