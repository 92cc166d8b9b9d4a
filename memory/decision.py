"""Admission as a value: given a snapshot, a ceiling and a query, say what to do and why.

``decide`` is pure. Usage is the process footprint minus MLX's freed-buffer cache (which
``mx.clear_cache()`` returns; the engine clears it on EVICT and WAIT). The step needs
``usage + committed + predicted``; then, in order:

- it fits under the hard ceiling → ADMIT;
- it fits once part of the prefix cache is evicted → EVICT exactly the excess;
- it fits once in-flight requests also finish and release their memory → WAIT;
- nothing helps → REJECT, with a reason that says what the user can change.
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


class Outcome(str, Enum):
    ADMIT = "admit"
    EVICT = "evict"
    WAIT = "wait"
    REJECT = "reject"


@dataclass(frozen=True)
class AdmissionQuery:
    """What one step asks for, in bytes (all non-negative)."""

    predicted_bytes: int  # what this step needs on top of current usage
    committed_bytes: int = 0  # promised to admitted in-flight requests, not yet allocated
    evictable_bytes: int = 0  # prefix-cache bytes that could be freed now
    releasable_bytes: int = 0  # held or committed by in-flight requests: freed when they finish
    request_id: str | None = None

    def __post_init__(self) -> None:
        for name in ("predicted_bytes", "committed_bytes", "evictable_bytes", "releasable_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative")


@dataclass(frozen=True)
class Decision:
    """The outcome, the numbers behind it, and a sentence a user can act on."""

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


def usage_bytes(snapshot: MemorySnapshot) -> int:
    """Footprint minus MLX's reclaimable buffer cache (never negative)."""
    return max(0, snapshot.footprint_bytes - snapshot.allocator_cache_bytes)


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
    if over <= query.evictable_bytes + query.releasable_bytes:
        return make(
            Outcome.WAIT,
            f"It is {fb(over)} over; evicting {fb(query.evictable_bytes)} of prefix cache is "
            f"not enough, but in-flight requests will release {fb(query.releasable_bytes)} "
            "when they finish: waiting for memory.",
            code=CODE_WAITING,
        )
    short = over - query.evictable_bytes - query.releasable_bytes
    code = CODE_PROMPT_EXCEEDS_CEILING if predicted > hard else CODE_PREFILL_EXCEEDED
    return make(
        Outcome.REJECT,
        f"Even after evicting {fb(query.evictable_bytes)} of prefix cache and waiting for "
        f"in-flight requests ({fb(query.releasable_bytes)}) it is {fb(short)} short: "
        f"shorten the prompt, lower max_tokens, or {_raise_hint(ceiling.tier)}.",
        code=code,
    )
