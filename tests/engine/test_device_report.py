"""What the server logs at start about its device: Metal available, and usable."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import mlx.core as mx

from engine import EngineConfig, LoadedModel
from engine.client import EngineClient
from engine.device_report import device_report
from memory import MemoryGuard
from memory.probes.allocator import AllocatorProbe


def fake_mx(*, metal: bool, cuda: bool = False, gpu_fails: str | None = None) -> Any:
    def eval_(*_: Any) -> None:
        if gpu_fails:
            raise RuntimeError(gpu_fails)

    return SimpleNamespace(
        metal=SimpleNamespace(is_available=lambda: metal),
        cuda=SimpleNamespace(is_available=lambda: cuda),
        gpu="gpu", default_device=lambda: "Device(gpu, 0)" if metal or cuda else "Device(cpu, 0)",
        ones=lambda shape, stream=None: mx.ones(shape), add=lambda a, b, stream=None: a + b,
        eval=eval_, sum=mx.sum,
    )


def test_this_machine() -> None:
    report = device_report()
    assert report.metal_available == mx.metal.is_available()
    assert report.backend in ("metal", "cuda", "cpu") and report.describe().startswith("device ")


def test_metal_usable() -> None:
    report = device_report(fake_mx(metal=True))
    assert (report.backend, report.metal_available, report.metal_usable) == ("metal", True, True)
    assert report.describe() == "device Device(gpu, 0), backend metal, Metal usable"


def test_metal_available_but_failing() -> None:
    # what a process without access to the GPU could see: Metal reported, a kernel fails
    report = device_report(fake_mx(metal=True, gpu_fails="[METAL] Command buffer execution failed"))
    assert report.metal_available and not report.metal_usable
    assert "not usable (RuntimeError: [METAL] Command buffer execution failed)" in report.describe()


def test_no_metal() -> None:
    report = device_report(fake_mx(metal=False, cuda=True))
    assert report.backend == "cuda" and report.describe().endswith("Metal not available")


def test_the_engine_logs_its_device_at_start(tiny_loaded: LoadedModel, caplog) -> None:
    async def run() -> None:
        client = EngineClient(load=lambda: tiny_loaded, guard=MemoryGuard(AllocatorProbe(), enabled=False),
                              config=EngineConfig(), max_queue=4)
        await client.start()
        await client.shutdown(1.0)

    with caplog.at_level(logging.INFO, logger="mlx_headroom.engine"):
        asyncio.run(run())
    lines = [r for r in caplog.records if r.getMessage().startswith("MLX: device ")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].getMessage() == "MLX: " + device_report().describe()
    assert lines[0].device["metal_usable"] == device_report().metal_usable  # type: ignore[attr-defined]
