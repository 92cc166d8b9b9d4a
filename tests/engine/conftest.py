"""Drive a real EngineCore on the tiny model, step by step, on the test's own thread.

No server and no mocks: requests go in through `submit`, steps run through `step()`,
and outputs are collected as the engine publishes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine import EngineConfig, EngineCore, EngineRequest, LoadedModel, RequestOutput, load_model
from memory import MemoryGuard
from memory.probes.allocator import AllocatorProbe

MODEL = "mlx-headroom/tiny-chat"


@dataclass
class Collected:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)  # prompt tokens served from the cache

    def __call__(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_tokens)
            self.logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.logprobs)
            if out.finish_reason is not None:
                self.finished[out.request_id] = out.finish_reason
                self.cached[out.request_id] = out.cached_tokens


@dataclass
class Harness:
    core: EngineCore
    out: Collected

    def submit(self, request: EngineRequest) -> None:
        self.core.submit(request)
        self.core._drain_inbox(timeout=0)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.core._drain_inbox(timeout=0)

    def step(self) -> None:
        self.core._drain_inbox(timeout=0)
        self.core.step()

    def run_until(self, done: Callable[[], bool], max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError("engine did not get there")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_path: Path) -> LoadedModel:
    return load_model(str(tiny_model_path), model_id=MODEL)


@pytest.fixture
def make_engine(tiny_loaded: LoadedModel) -> Callable[..., Harness]:
    def make(guard: MemoryGuard | None = None, loaded: LoadedModel | None = None,
             **config: object) -> Harness:
        guard = guard or MemoryGuard(AllocatorProbe(), enabled=False)
        out = Collected()
        core = EngineCore(loaded or tiny_loaded, guard, EngineConfig(**config), out)  # type: ignore[arg-type]
        return Harness(core, out)

    return make


@pytest.fixture(scope="module")
def window_loaded(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny sliding-window model (tests/engine/window_model.py), saved and loaded."""
    from tests.engine import window_model

    path = window_model.save_window_model(tmp_path_factory.mktemp("models") / "window", tiny_model_path)
    return load_model(str(path))
