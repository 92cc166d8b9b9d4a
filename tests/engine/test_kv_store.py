"""KVStore: reservations in whole blocks, segments, in-place writes, plain paged attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kv import KVGeometry, KVStore, decode_caches, plan_decode, prefill_caches
from engine.kv.attention import decode_attention

GEO = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype=mx.float32)


def test_a_reservation_is_its_own_length_in_whole_blocks():
    s = KVStore(GEO, block_size=16, segment_tokens=4096)
    s.reserve("long", 32_000 // 16 * 16)  # too big for a default segment: its own
    for i in range(31):
        s.reserve(f"short{i}", 1000 + i)
    own = 32_000 + sum(1000 + i for i in range(31))
    assert s.reserved_bytes() <= 1.15 * own * GEO.bytes_per_token
    assert s.reserved_bytes() == sum(-(-t // 16) * 16 for t in [32_000, *(1000 + i for i in range(31))]) * (
        GEO.bytes_per_token
    )


def test_segments_fill_then_grow_and_empty_ones_are_dropped():
    s = KVStore(GEO, block_size=16, segment_tokens=256)
    assert s.growth_bytes(100) == 256 * GEO.bytes_per_token
    assert s.growth_bytes(100, exact=True) == 112 * GEO.bytes_per_token
    s.reserve("a", 100)
    assert s.growth_bytes(100) == 0  # 9 of 16 blocks left
    s.reserve("b", 100)
    assert len(s.segments) == 1
    s.reserve("c", 100)
    assert len(s.segments) == 2
    s.release("a")
    s.release("b")
    assert len(s.segments) == 1
    s.release("c")
    assert s.pool_bytes() == 0


def test_writes_happen_in_place_and_never_copy_the_pool():
    """A stray reference would turn every write into a copy of the whole segment."""
    s = KVStore(GEO, block_size=16, segment_tokens=8192)
    allocs = [s.reserve(f"r{i}", 1000) for i in range(4)]
    seg = allocs[0].segment
    layer_bytes = seg.keys[0].nbytes
    for a in allocs:
        s.advance(a.request_id, 10)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(200):
        plan = plan_decode(s, allocs)
        for cache in decode_caches(plan, GEO.num_layers):
            k = mx.random.normal((4, 2, 1, 32))
            cache.update_and_fetch(k, k)
        mx.eval(seg.arrays())
        for a in allocs:
            s.advance(a.request_id, 1)
    growth = mx.get_peak_memory() - before
    assert growth < layer_bytes // 2, (growth, layer_bytes)
    assert mx.get_active_memory() - before < layer_bytes // 8
    # the measurement sees a copy: hold a view of the pool, and the next write copies it
    stray = seg.keys[0][0:1]
    mx.eval(stray)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = decode_caches(plan_decode(s, allocs), GEO.num_layers)[0]
    k = mx.random.normal((4, 2, 1, 32))
    cache.update_and_fetch(k, k)
    mx.eval(seg.keys[0])
    assert mx.get_peak_memory() - before >= layer_bytes


def test_plain_paged_attention_matches_attention_over_each_row_alone():
    rng = np.random.default_rng(0)
    s = KVStore(GEO, block_size=16, segment_tokens=64)  # rows spread over segments
    lengths = [5, 70, 33, 1, 48]
    allocs = []
    rows_kv = []
    for i, n in enumerate(lengths):
        a = s.reserve(f"r{i}", n + 4)
        k = mx.array(rng.standard_normal((1, 2, n, 32)).astype(np.float32))
        v = mx.array(rng.standard_normal((1, 2, n, 32)).astype(np.float32))
        for cache in prefill_caches(s, a, n):
            cache.update_and_fetch(k, v)
        s.advance(a.request_id, n)
        allocs.append(a)
        rows_kv.append((k, v))
    assert len(s.segments) > 1
    plan = plan_decode(s, allocs)
    q = mx.array(rng.standard_normal((5, 4, 1, 32)).astype(np.float32))
    knew = mx.array(rng.standard_normal((5, 2, 1, 32)).astype(np.float32))
    cache = decode_caches(plan, GEO.num_layers)[1]
    cache.update_and_fetch(knew, knew)
    out = decode_attention(q, cache, 0.2)
    for i, (k, v) in enumerate(rows_kv):
        kk = mx.concatenate([k, knew[i : i + 1]], axis=2)
        vv = mx.concatenate([v, knew[i : i + 1]], axis=2)
        ref = mx.fast.scaled_dot_product_attention(q[i : i + 1], kk, vv, scale=0.2)
        assert np.allclose(np.array(out[i : i + 1]), np.array(ref), atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_plain_paths_length_mask_is_additive_in_the_queries_dtype(dtype):
    """A boolean mask is materialised across every query head on CUDA (docs/throughput.md);
    the plain decode path (the CPU, Metal, and CUDA shapes the kernel does not take) passes
    0 / -inf in the queries' dtype: 0 up to each row's length, -inf past it."""
    s = KVStore(GEO, block_size=16, segment_tokens=256)
    allocs = []
    for i, n in enumerate([5, 40, 17]):
        allocs.append(s.reserve(f"m{i}", n + 4))
        s.advance(f"m{i}", n)
    (g,) = plan_decode(s, allocs).groups
    _, mask = g.plain_indices(16, GEO.num_kv_heads, dtype)
    assert mask.dtype == dtype and mask.shape == (3, 1, 1, 48)
    m = np.array(mask.astype(mx.float32))[:, 0, 0]
    for row, n in enumerate([6, 41, 18]):  # the new token included
        assert (m[row, :n] == 0).all() and np.isneginf(m[row, n:]).all()


def test_outgrowing_a_reservation_is_an_error_not_a_silent_copy():
    s = KVStore(GEO, block_size=16)
    s.reserve("a", 20)
    s.advance("a", 32)
    with pytest.raises(RuntimeError, match="outgrew"):
        s.advance("a", 1)


def test_default_segment_sizes_per_backend():
    """CUDA: an eighth of the card, clamped to 2-16 GiB (one segment per decode step at
    the concurrencies served there); the CPU keeps small segments; Metal 2 GiB."""
    from engine.kv.store import CPU_SEGMENT_TOKENS, default_segment_tokens

    per_token = 128 * 1024  # an 8B model in bf16
    gib = 1 << 30
    assert default_segment_tokens("cuda", per_token, 141 * gib) == 16 * gib // per_token  # H200
    assert default_segment_tokens("cuda", per_token, 24 * gib) == 3 * gib // per_token
    assert default_segment_tokens("cuda", per_token, 8 * gib) == 2 * gib // per_token  # floor
    assert default_segment_tokens("cuda", per_token, None) == 16384  # card unknown: as Metal
    assert default_segment_tokens("metal", per_token) == 16384
    assert default_segment_tokens("cpu", per_token, 141 * gib) == CPU_SEGMENT_TOKENS


def _plan_arrays(plan) -> list:
    out = [np.array(plan.offsets), None if plan.order is None else np.array(plan.order)]
    for g in plan.groups:
        out += [g.segment.id, None if g.rows is None else np.array(g.rows), np.array(g.write),
                np.array(g.table), np.array(g.lengths), g.max_length]
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
        for x, y in zip(a, b, strict=True))


def test_kept_decode_tables_plan_what_a_fresh_plan_would_as_rows_move_leave_and_return():
    """The runner keeps its block tables between steps (`DecodeTables`). Each step's plan
    must still be what building it afresh gives: rows advance, leave, reorder, spread over
    two segments, and a request released and reserved again under the same id holds other
    blocks (a cache keyed by request id would address the old ones)."""
    from engine.kv.cache import DecodeTables

    s = KVStore(GEO, block_size=16, segment_tokens=512)
    kept = DecodeTables()
    allocs = [s.reserve(f"r{i}", 100 + 40 * i) for i in range(3)]  # 7, 9, 12 blocks of 32
    for a in allocs:
        s.advance(a.request_id, 20)

    def check(rows) -> None:
        assert _same(_plan_arrays(plan_decode(s, rows, kept)), _plan_arrays(plan_decode(s, rows)))

    check(allocs)
    for _ in range(20):  # across a block boundary
        for a in allocs:
            s.advance(a.request_id, 1)
        check(allocs)
    s.release("r0")  # between two steps of the same three ids
    s.reserve("filler", 16)  # r0's first block goes to another request
    again = s.reserve("r0", 100)
    s.advance("r0", 20)
    assert again.table != allocs[0].table
    rows = [again, *allocs[1:]]
    check(rows)
    check(rows[::-1])
    check(rows[1:])
    other = s.reserve("big", 300)  # no room left in the first segment: a second one
    s.advance("big", 7)
    assert other.segment is not allocs[1].segment
    check([*rows, other])
    check([other, *rows])


def test_kept_decode_tables_do_not_keep_a_released_segment_alive():
    """Once its last request is released, a segment's pool must go back to the device. The
    first version of `DecodeTables` held the segment (and the reservations) strongly, and
    the engine's preemption test found the memory still counted."""
    import gc
    import weakref

    from engine.kv.cache import DecodeTables

    s = KVStore(GEO, block_size=16, segment_tokens=64)
    kept = DecodeTables()
    alloc = s.reserve("only", 40)
    s.advance("only", 3)
    plan = plan_decode(s, [alloc], kept)
    segment = weakref.ref(alloc.segment)
    s.release("only")
    del alloc, plan
    gc.collect()
    assert not s.segments and segment() is None
