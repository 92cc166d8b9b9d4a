"""bench.engine_step times the server's own decode step: with `--compile-decode` its timed
steps are replays of a traced graph, and the census counts the replayed graph's kernels."""

from __future__ import annotations

import threading
import time

import mlx.core as mx

from bench.engine_step import engine_steps, gil_holder
from engine.dummy_model import build_dummy_model, dummy_config
from engine.fusion import fuse_projections


def _model():
    model = build_dummy_model(dummy_config("tiny", "float32"))
    fuse_projections(model)
    mx.eval(model.parameters())
    return model


def test_the_compiled_step_replays_every_timed_step_and_counts_fused_kernels() -> None:
    model = _model()
    eager: dict = {}
    engine_steps(model, 2, 48, 6, 0.0, split=eager)
    compiled: dict = {}
    engine_steps(model, 2, 48, 6, 0.0, split=compiled, compile_decode=True)
    assert eager["replayed"] is None
    assert compiled["replayed"] == 6
    assert compiled["ops"] < eager["ops"]
    fused = {name for name in compiled["census"] if name.startswith("Compiled")}
    assert fused - set(eager["census"])  # kernels only the traced graph has (mlx-lm compiles a few too)
    assert compiled["gpu_busy_pct"] is None  # no NVML on the CPU


def test_added_host_work_lands_in_the_steps_host_time() -> None:
    """On the CPU nothing overlaps the host work, so every added millisecond shows in the
    step's host share: the control for the H200, where pipelining may hide it.

    The device share is compared as a ratio, not the steps' wall times as a difference: on
    a busy 2-core machine one run's 3 ms of device work can take 6 ms, which once ate 1.6 ms
    of a 25 ms margin. Had the spin overlapped the device work, the loaded steps' wait and
    queue would fall towards zero, far below half the plain steps'."""
    model = _model()
    plain: dict = {}
    engine_steps(model, 2, 48, 6, 0.0, split=plain)
    loaded: dict = {}
    engine_steps(model, 2, 48, 6, 0.0, split=loaded, host_work_ms=25.0)
    assert loaded["host_ms"] - plain["host_ms"] >= 24.0

    def device_share(split: dict) -> float:
        return split["wait_ms"] + split["queue_ms"]

    assert device_share(loaded) >= 0.5 * device_share(plain)
    assert loaded["ms"] >= 25.0 + device_share(loaded)


def test_the_side_thread_holds_the_gil_in_bursts_and_stops() -> None:
    before = threading.active_count()
    progress = 0
    start = time.perf_counter()
    with gil_holder(burst_ms=8.0, period_ms=10.0):
        while time.perf_counter() - start < 0.3:
            progress += 1
            time.sleep(0)  # let the holder in
    assert threading.active_count() == before
    spun_only = 0
    start = time.perf_counter()
    while time.perf_counter() - start < 0.3:
        spun_only += 1
        time.sleep(0)
    assert progress < spun_only * 0.6  # the holder took most of the GIL for 8 ms in 10
