"""A prefill chunk reads its request's K/V as a view of the pool where they lie in one run.

Gathering a long request's K/V for every layer of every chunk copies the whole context each
time; where the request's blocks are consecutive ids (a reservation in a segment with a
free run gets one), `PrefillCache` hands SDPA a strided view instead. These tests check that
the view gives exactly what the gather gives, in the model's dtype and quantized, and that
fragmented blocks still gather.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from engine.kv import KVGeometry, KVStore, install_attention_hook, prefill_caches
from engine.kv.blocks import consecutive


def _fragmented(store: KVStore) -> None:
    """Hold every other block of a fresh segment, so that no run of two is free."""
    for i in range(store.segment_blocks):
        store.reserve(f"hold{i}", store.block_size)
    for i in range(0, store.segment_blocks, 2):
        store.release(f"hold{i}")


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_request_on_one_run_of_blocks_prefills_from_a_view_with_the_gathered_logits(
        tiny_loaded, kv_bits: int | None) -> None:
    model = tiny_loaded.model
    assert install_attention_hook(model)
    g = tiny_loaded.kv_geometry()
    geometry = KVGeometry(g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, kv_bits=kv_bits,
                          kv_group_size=32)
    prompt = [random.Random(11).randrange(0, 256) for _ in range(200)]
    logits = []
    for fragment in (False, True):
        store = KVStore(geometry, segment_tokens=1024)
        if fragment:
            _fragmented(store)
        alloc = store.reserve("r", len(prompt))
        assert consecutive(alloc.table) is not fragment
        out = []
        for start in range(0, len(prompt), 64):
            piece = prompt[start:start + 64]
            caches = prefill_caches(store, alloc, len(piece))
            assert (caches[0]._read is None) is not fragment  # the view, or the gather
            out.append(np.array(model(mx.array(piece)[None], cache=caches)[0]))
            store.advance("r", len(piece))
        logits.append(np.concatenate(out))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_the_view_is_the_request_s_own_slots_in_order() -> None:
    """Attention itself on random K/V: the view covers exactly positions 0 to the chunk's
    end, written this chunk included, and not a slot of a neighbour."""
    geometry = KVGeometry(1, 2, 32, mx.float32)
    store = KVStore(geometry, segment_tokens=512)
    store.reserve("neighbour", 40)
    alloc = store.reserve("r", 100)
    assert consecutive(alloc.table) and alloc.table[0] > 0
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.standard_normal((1, 2, 100, 32)).astype(np.float32)) for _ in range(2))
    prefill_caches(store, alloc, 60)[0].update_and_fetch(k[:, :, :60], v[:, :, :60])
    store.advance("r", 60)
    cache = prefill_caches(store, alloc, 40)[0]
    keys, values = cache.update_and_fetch(k[:, :, 60:], v[:, :, 60:])
    assert cache._read is None
    np.testing.assert_array_equal(np.array(keys), np.array(k))
    np.testing.assert_array_equal(np.array(values), np.array(v))


def test_padded_keys_read_from_the_view_give_the_unpadded_attention() -> None:
    """Where keys are padded, the view runs past the chunk's end over whatever the segment
    holds there (here another request's K/V of large magnitude), masked: the same output
    as the exact keys. A run too close to the segment's end to hold the padding gathers."""
    geometry = KVGeometry(1, 2, 32, mx.float32)
    rng = np.random.default_rng(1)
    k, v = (mx.array(rng.standard_normal((1, 2, 100, 32)).astype(np.float32)) for _ in range(2))
    q = mx.array(rng.standard_normal((1, 4, 40, 32)).astype(np.float32))
    outs = []
    for bucket in (0, 64):
        store = KVStore(geometry, segment_tokens=512, key_bucket=bucket)
        alloc = store.reserve("r", 100)
        other = store.reserve("after", 200)
        loud = mx.full((1, 2, 200, 32), 50.0)
        prefill_caches(store, other, 200)[0].update_and_fetch(loud, loud)
        prefill_caches(store, alloc, 60)[0].update_and_fetch(k[:, :, :60], v[:, :, :60])
        store.advance("r", 60)
        cache = prefill_caches(store, alloc, 40)[0]
        keys, values = cache.update_and_fetch(k[:, :, 60:], v[:, :, 60:])
        assert cache._read is None and keys.shape[2] == (128 if bucket else 100)
        mask = cache.make_mask(40)
        outs.append(np.array(mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2, mask=mask)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    tight = KVStore(geometry, segment_tokens=112, key_bucket=64)  # 7 blocks: 100 keys fit, 128 do not
    cache = prefill_caches(tight, tight.reserve("r", 100), 100)[0]
    assert cache._read is not None and cache._read.shape[-1] == 128
