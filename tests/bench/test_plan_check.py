"""`python -m bench.plan_check`: on the engine's own store, each chunk after the first runs at
the exact shape the chunk before planned (on the CPU nothing is planned, so only the
mechanism is checked here; the timings are the GPU's to read)."""

from __future__ import annotations

import mlx.core as mx

from bench.plan_check import run


def test_chunks_after_the_first_attend_the_exact_shape_planned_ahead() -> None:
    rows = run(128, 304, 3, True, mx.float32)  # ends 432, 560, 688: none a padded length
    assert [(r["exact"], r["planned_ahead"]) for r in rows] == [(0, 0), (1, 1), (1, 1)]
    first = run(128, 320, 2, False, mx.float32)
    assert all(r["exact"] and not r["planned_ahead"] and r["again_ms"] is not None for r in first)
