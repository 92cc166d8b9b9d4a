"""`mx.set_wired_limit` for the loaded models' weights: the decision (table-driven), the
process-wide sum over models, and the call through the engine client's start and shutdown.
MLX's setter is a no-op on Linux and CUDA, so a recording setter stands in for Metal's."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineConfig, LoadedModel
from engine.client import EngineClient
from engine.wired import WiredWeights, decide_wired_limit
from memory import MemoryGuard
from memory.probes.allocator import AllocatorProbe

GiB = 1 << 30


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
    wired.release("c")
    wired.release("a")
    assert wired.limit_bytes == 4 * GiB
    wired.release("b")
    assert setter.calls == [8 * GiB, 12 * GiB, 0, 12 * GiB, 4 * GiB, 0]
    wired.release("b")  # twice: nothing more to set
    assert wired.sets == 6


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
