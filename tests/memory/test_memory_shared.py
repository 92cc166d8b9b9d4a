"""One guard, several engines: each engine's question counts what the others were admitted
for and have not allocated yet (memory/shared.py)."""

from __future__ import annotations

from memtest_helpers import FixedProbe, GiB, snap

from memory import AdmissionQuery, MemoryGuard, Outcome, Tier
from memory.shared import GuardView, SharedCommitments


def views() -> tuple[GuardView, GuardView, SharedCommitments]:
    # 10 GiB in use under a 16 GiB ceiling: 6 GiB of room for everyone together.
    guard = MemoryGuard(FixedProbe(snap()), tier=Tier.CUSTOM, custom_ceiling_bytes=16 * GiB)
    shared = SharedCommitments()
    return GuardView(guard, shared, "a"), GuardView(guard, shared, "b"), shared


def test_an_engine_sees_what_another_was_admitted_for() -> None:
    a, b, shared = views()
    assert a.check(AdmissionQuery(predicted_bytes=4 * GiB)).outcome is Outcome.ADMIT
    assert shared.snapshot() == {"a": 4 * GiB}
    # Alone, b's 4 GiB would fit in the 6 GiB of room; with a's 4 GiB counted it does not.
    decision = b.check(AdmissionQuery(predicted_bytes=4 * GiB, solo_bytes=4 * GiB,
                                      baseline_bytes=10 * GiB))
    assert decision.outcome is Outcome.WAIT
    assert b.check(AdmissionQuery(predicted_bytes=2 * GiB)).outcome is Outcome.ADMIT
    assert shared.snapshot() == {"a": 4 * GiB, "b": 2 * GiB}


def test_an_entry_ends_with_the_engines_next_question_or_its_unload() -> None:
    a, b, shared = views()
    a.check(AdmissionQuery(predicted_bytes=4 * GiB))
    a.check(AdmissionQuery(predicted_bytes=0))  # the idle upkeep: nothing predicted
    assert b.check(AdmissionQuery(predicted_bytes=5 * GiB)).outcome is Outcome.ADMIT
    shared.drop("b")  # the model was unloaded
    assert a.check(AdmissionQuery(predicted_bytes=5 * GiB)).outcome is Outcome.ADMIT


def test_a_refused_question_promises_nothing() -> None:
    a, b, shared = views()
    assert a.check(AdmissionQuery(predicted_bytes=9 * GiB, solo_bytes=9 * GiB,
                                  baseline_bytes=10 * GiB)).outcome is Outcome.REJECT
    assert shared.snapshot() == {"a": 0}
    assert b.state() == a.state()  # everything else is the one guard's
