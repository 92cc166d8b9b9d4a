"""Small per-step vectors stay out of MLX's 8-byte scalar blocks (`engine.kv.device_vectors`).

On CUDA those blocks live in host memory that every reading kernel block waits on; the
CPU allocator counts a buffer's bytes exactly, so the padding is visible here as active
memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.kv import KVGeometry, KVStore
from engine.kv.cache import DecodeTables
from engine.kv.device_vectors import MIN_BYTES, device_vector


def _allocated(make: Callable[[], Any]) -> tuple[Any, int]:  # what `make` builds, and its bytes
    mx.synchronize()
    before = mx.get_active_memory()
    out = make()
    mx.eval(out)
    return out, mx.get_active_memory() - before


@pytest.mark.parametrize("values", [[7], [7, 9], [1, 2, 3], list(range(6))])
@pytest.mark.parametrize("dtype", [mx.int32, mx.float32])
def test_a_vector_keeps_its_values_in_a_buffer_of_at_least_min_bytes(
    values: list[int], dtype: mx.Dtype
) -> None:
    vec, held = _allocated(lambda: device_vector(np.asarray(values), dtype))
    assert vec.shape == (len(values),)
    assert vec.dtype == dtype
    assert vec.tolist() == [float(v) if dtype == mx.float32 else v for v in values]
    assert held >= max(MIN_BYTES, 4 * len(values))


def test_a_batch_of_one_plans_its_slots_lengths_and_positions_outside_the_scalar_blocks() -> None:
    geo = KVGeometry(num_layers=1, num_kv_heads=2, head_dim=32, dtype=mx.float32)
    store = KVStore(geo, block_size=16, segment_tokens=1024)
    alloc = store.reserve("one", 100)
    store.advance("one", 37)
    tables = DecodeTables()
    tables.plan(store, [alloc])  # builds the kept block table
    plan, held = _allocated(lambda: tables.plan(store, [alloc]))
    (g,) = plan.groups
    arrays = [g.write, g.lengths, plan.offsets]
    assert [a.tolist() for a in arrays] == [[alloc.table[37 // 16] * 16 + 37 % 16], [38], [37]]
    assert held >= len(arrays) * MIN_BYTES
