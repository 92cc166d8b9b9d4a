"""bench.engine_step times the server's own decode step: with `--compile-decode` its timed
steps are replays of a traced graph, and the census counts the replayed graph's kernels."""

from __future__ import annotations

import mlx.core as mx

from bench.engine_step import engine_steps
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
