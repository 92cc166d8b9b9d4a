"""The values the ranks exchange, without a group: messages, the injection, the tightest rank."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.distributed.channel import ROW_WORDS, ChannelError, _pack, _unpack, words_for
from engine.distributed.lockstep import decision_from_json, decision_to_json
from engine.distributed.probe import GroupProbe, injected_extra_bytes
from memory import Decision, MemorySnapshot, Outcome


def snap(footprint: int) -> MemorySnapshot:
    return MemorySnapshot(platform="allocator", total_bytes=10_000, footprint_bytes=footprint,
                          allocator_active_bytes=footprint, allocator_cache_bytes=0, free_bytes=0,
                          inactive_bytes=0, active_bytes=0, wired_bytes=0, device_cap_bytes=None,
                          taken_at=0.0)


class Fixed:
    def __init__(self, footprint: int) -> None:
        self.footprint = footprint

    def read(self) -> MemorySnapshot:
        return snap(self.footprint)


@pytest.mark.parametrize("obj", [{}, {"plan": {"ops": [["submit", {"prompt": list(range(300))}]]}},
                                 {"s": "naïve ☃"}, [1, 2, 3], None])
def test_a_message_comes_back_as_sent(obj: object) -> None:
    assert _unpack(np.array(_pack(obj, ROW_WORDS))) == obj
    assert words_for(obj) <= ROW_WORDS


def test_a_message_too_long_for_its_slot_is_refused() -> None:
    with pytest.raises(ChannelError):
        _pack({"prompt": list(range(5000))}, ROW_WORDS)


def test_a_decision_crosses_intact() -> None:
    d = Decision(outcome=Outcome.REJECT, reason="no", needed_bytes=5, limit_bytes=4, binding="custom",
                 usage_bytes=3, predicted_bytes=2, code="prefill_memory_exceeded", request_id="r")
    assert decision_from_json(decision_to_json(d)) == d


@pytest.mark.parametrize(("spec", "rank", "extra"), [
    ("", 1, 0), ("1=100", 1, 100), ("1=100", 0, 0), ("0=5, 1=7", 1, 7), ("2=9", 1, 0)])
def test_the_injection_names_one_rank(spec: str, rank: int, extra: int) -> None:
    assert injected_extra_bytes(rank, {"MLX_HEADROOM_TP_EXTRA_BYTES": spec}) == extra


@pytest.mark.parametrize(("mine", "others", "binding"), [
    (100, {1: 50}, 0),     # rank 0 fuller
    (100, {1: 500}, 1),    # rank 1 fuller: its reading is the one admission sees
    (100, {1: 100}, 0),    # a tie goes to the lower rank
    (100, {1: 50, 2: 900}, 2),
])
def test_the_tightest_rank_binds(mine: int, others: dict[int, int], binding: int) -> None:
    probe = GroupProbe(Fixed(mine), 1 + len(others))
    probe.headroom = lambda s: 1000 - s.footprint_bytes
    probe.update({r: snap(f) for r, f in others.items()})
    readings = probe.readings()
    assert probe.binding_rank(readings) == binding
    expected = mine if binding == 0 else others[binding]
    assert probe.read().footprint_bytes == expected
    assert [r.rank for r in readings] == sorted([0, *others])
    assert dataclasses.replace(probe.read(), taken_at=0.0) == snap(expected)
