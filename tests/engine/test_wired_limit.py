"""`mx.set_wired_limit` for the loaded models' weights: the decision (table-driven), the
process-wide sum over models, the call through the engine client's start and shutdown, the
room check again when a model unloads, and the limit as reported (and as doctor predicts it).
MLX's setter is a no-op on Linux and CUDA, so a recording setter stands in for Metal's."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import pytest

from engine import EngineConfig, LoadedModel
from engine.client import EngineClient
from engine.wired import WiredWeights, decide_wired_limit
from memory import MemoryGuard, Tier
from memory.probes.allocator import AllocatorProbe
from memory.probes.base import mlx_allocator_bytes
from server import doctor

GiB = 1 << 30
MiB = 1 << 20


@pytest.mark.parametrize(
    ("weights", "working_set", "ceiling", "wired", "why"),
    [
        (8 * GiB, 48 * GiB, 40 * GiB, 8 * GiB, "wired the weights"),
        (0, 48 * GiB, 40 * GiB, 0, "no weights"),
        (8 * GiB, None, 40 * GiB, 0, "not Metal"),  # Linux, CUDA
        (44 * GiB, 48 * GiB, None, 0, "90%"),  # near the working set: not pinned
        (30 * GiB, 48 * GiB, 20 * GiB, 0, "guard's ceiling"),  # no room under the guard
        (30 * GiB, 48 * GiB, None, 30 * GiB, "wired"),  # guard off: the working set decides
    ],
)
def test_decide(weights: int, working_set: int | None, ceiling: int | None, wired: int,
                why: str) -> None:
    decision = decide_wired_limit(weights, working_set=working_set, ceiling=ceiling)
    assert decision.limit_bytes == wired and why in decision.reason


class Setter:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[int] = []
        self.fail = fail

    def __call__(self, limit: int) -> int:
        if self.fail:
            raise ValueError("[metal::set_wired_limit] larger than the maximum working set size")
        previous = self.calls[-1] if self.calls else 0
        self.calls.append(limit)
        return previous


def test_the_models_weights_are_summed_and_released() -> None:
    setter = Setter()
    wired = WiredWeights(setter=setter, working_set=lambda: 48 * GiB)
    wired.hold("a", 8 * GiB, ceiling=40 * GiB)
    wired.hold("b", 4 * GiB, ceiling=40 * GiB)
    assert wired.limit_bytes == 12 * GiB
    wired.hold("c", 30 * GiB, ceiling=40 * GiB)  # 42 GiB: over the guard's room, none wired
    assert wired.limit_bytes == 0
    wired.release("c", ceiling=40 * GiB)
    wired.release("a", ceiling=40 * GiB)
    assert wired.limit_bytes == 4 * GiB
    wired.release("b", ceiling=40 * GiB)
    assert setter.calls == [8 * GiB, 12 * GiB, 0, 12 * GiB, 4 * GiB, 0]
    wired.release("b", ceiling=40 * GiB)  # twice: nothing more to set
    assert wired.sets == 6


def test_a_release_wires_the_others_only_under_the_ceiling_now() -> None:
    setter = Setter()
    wired = WiredWeights(setter=setter, working_set=lambda: 48 * GiB)
    wired.hold("a", 8 * GiB, ceiling=40 * GiB)
    wired.hold("b", 30 * GiB, ceiling=40 * GiB)
    assert wired.limit_bytes == 38 * GiB
    decision = wired.release("a", ceiling=20 * GiB)  # memory got scarce meanwhile: b alone is over
    assert wired.limit_bytes == 0 and "guard's ceiling" in decision.reason
    assert setter.calls == [8 * GiB, 38 * GiB, 0]


def test_the_reported_limit_is_null_where_setting_it_is_a_no_op() -> None:
    linux = WiredWeights(setter=Setter(), working_set=lambda: None)
    linux.hold("a", 8 * GiB, ceiling=None)
    assert linux.reported_limit_bytes() is None
    metal = WiredWeights(setter=Setter(), working_set=lambda: 48 * GiB)
    assert metal.reported_limit_bytes() == 0  # a device that could wire: nothing wired yet
    metal.hold("a", 8 * GiB, ceiling=None)
    assert metal.reported_limit_bytes() == 8 * GiB


def test_a_refused_setter_leaves_nothing_wired() -> None:
    wired = WiredWeights(setter=Setter(fail=True), working_set=lambda: 48 * GiB)
    decision = wired.hold("a", 8 * GiB, ceiling=None)
    assert wired.limit_bytes == 0 and "failed" in decision.reason


def test_the_engine_wires_at_start_and_releases_at_shutdown(tiny_loaded: LoadedModel) -> None:
    setter = Setter()
    wired = WiredWeights(setter=setter, working_set=lambda: 48 * GiB)
    guard = MemoryGuard(AllocatorProbe(), enabled=False)

    async def run() -> None:
        client = EngineClient(load=lambda: tiny_loaded, guard=guard, config=EngineConfig(),
                              max_queue=4, wired=wired)
        await client.start()
        assert setter.calls == [tiny_loaded.weight_bytes]
        await client.shutdown(1.0)

    asyncio.run(run())
    assert setter.calls == [tiny_loaded.weight_bytes, 0]
    assert wired.limit_bytes == 0


class FailingAllocator:
    """MLX's allocator counts, until told to fail like a probe that cannot read."""

    def __init__(self) -> None:
        self.fail = False

    def __call__(self) -> tuple[int, int]:
        if self.fail:
            raise OSError("injected probe failure")
        return mlx_allocator_bytes()


def _lower_the_ceiling(guard: MemoryGuard, allocator: FailingAllocator) -> None:
    guard.configure(ceiling_bytes=32 * MiB)  # below the other model's 64 MiB


def _break_the_probe(guard: MemoryGuard, allocator: FailingAllocator) -> None:
    allocator.fail = True  # no reading, no promise of room


@pytest.mark.parametrize("change", [_lower_the_ceiling, _break_the_probe])
def test_an_engine_shutdown_rewires_the_other_models_under_the_room_check(
        tiny_loaded: LoadedModel, change: Callable[[MemoryGuard, FailingAllocator], None]) -> None:
    """Another model's 64 MiB were wired beside this engine's weights; once this engine
    stops, they must not be wired again past a ceiling that fell, nor without a reading."""
    setter = Setter()
    wired = WiredWeights(setter=setter, working_set=lambda: 48 * GiB)
    wired.hold("other", 64 * MiB, ceiling=None)
    allocator = FailingAllocator()
    guard = MemoryGuard(AllocatorProbe(allocator=allocator), tier=Tier.CUSTOM,
                        custom_ceiling_bytes=1 * GiB)
    both = 64 * MiB + tiny_loaded.weight_bytes

    async def run() -> None:
        client = EngineClient(load=lambda: tiny_loaded, guard=guard, config=EngineConfig(),
                              max_queue=4, wired=wired)
        await client.start()
        assert setter.calls == [64 * MiB, both]
        change(guard, allocator)
        await client.shutdown(1.0)

    asyncio.run(run())
    assert setter.calls == [64 * MiB, both, 0]
    assert wired.limit_bytes == 0


@pytest.mark.parametrize(
    ("weights", "working_set", "ceiling", "limit", "why"),
    [
        (8 * GiB, None, 40 * GiB, None, "no-op"),  # Linux, CUDA: nothing to predict
        (None, 48 * GiB, 40 * GiB, None, "--model"),  # a Mac, no model to size
        (8 * GiB, 48 * GiB, 40 * GiB, 8 * GiB, "wired the weights"),
        (30 * GiB, 48 * GiB, 20 * GiB, 0, "guard's ceiling"),
    ],
)
def test_doctor_reports_what_serve_would_wire(weights: int | None, working_set: int | None,
                                              ceiling: int | None, limit: int | None, why: str) -> None:
    view = doctor.wired_view(weights, working_set, ceiling)
    assert view["limit_bytes"] == limit and why in view["reason"]


@pytest.mark.skipif(sys.platform == "darwin", reason="on Linux, where wiring is a no-op")
def test_doctor_prints_the_wired_limit_with_the_memory_report() -> None:
    from server.settings import Settings

    report = doctor.collect(Settings(memory_probe="allocator"), model=None, max_tokens=None)
    assert report["wired_limit"]["limit_bytes"] is None  # this is Linux: a no-op
    text = doctor.render(report)
    assert "wired     mx.set_wired_limit none: mx.set_wired_limit is a no-op" in text
    assert text.index("ceiling   ") < text.index("wired     ")
