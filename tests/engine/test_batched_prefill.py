"""Batched prefill: several prompts' chunks in one model call give what each gives alone.

Real MLX on the tiny float32 model; the KV store is the engine's. Rows are ragged (chunk
lengths and starting positions differ), so padding, per-row RoPE offsets and the mask
are all exercised.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from engine.kv import KVGeometry, KVStore, install_attention_hook, prefill_caches
from engine.kv.prefill import PrefillRow, batch_prefill_caches, plan_prefill
from engine.request import EngineRequest, SamplingParams
from engine.runner import Runner
from engine.sequence import Sequence

# (prompt length, tokens already prefilled before the batched chunk, chunk length)
ROWS = [(70, 0, 70), (200, 64, 100), (33, 16, 5), (130, 0, 1), (90, 48, 42)]
SAME = [(150, 32, 64), (120, 32, 64), (96, 32, 64)]  # one shape: SDPA's "causal" mask


def _store(loaded) -> KVStore:
    g = loaded.kv_geometry()
    return KVStore(KVGeometry(g.num_layers, g.num_kv_heads, g.head_dim, g.dtype), segment_tokens=4096)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def _alone(model, store: KVStore, rid: str, prompt: list[int], done: int, n: int) -> mx.array:
    alloc = store.reserve(rid, len(prompt) + 8)
    if done:
        model(mx.array(prompt[:done])[None], cache=prefill_caches(store, alloc, done))
        mx.eval(alloc.segment.arrays())
        store.advance(rid, done)
    logits = model(mx.array(prompt[done:done + n])[None], cache=prefill_caches(store, alloc, n))
    mx.eval(logits, alloc.segment.arrays())
    store.advance(rid, n)
    return logits[0]


@pytest.mark.parametrize("shapes", [ROWS, SAME], ids=["ragged", "one-shape"])
def test_a_batched_call_gives_each_row_its_one_prompt_logits_and_kv(tiny_loaded, shapes):
    model = tiny_loaded.model
    assert install_attention_hook(model)
    alone_store, batch_store = _store(tiny_loaded), _store(tiny_loaded)
    prompts = [_prompt(100 + i, p) for i, (p, _, _) in enumerate(shapes)]
    alone = [_alone(model, alone_store, f"a{i}", prompts[i], done, n)
             for i, (_, done, n) in enumerate(shapes)]

    rows = []
    for i, (p, done, n) in enumerate(shapes):
        alloc = batch_store.reserve(f"b{i}", p + 8)
        if done:
            model(mx.array(prompts[i][:done])[None], cache=prefill_caches(batch_store, alloc, done))
            mx.eval(alloc.segment.arrays())
            batch_store.advance(f"b{i}", done)
        rows.append(PrefillRow(alloc, tuple(prompts[i][done:done + n])))
    plan = plan_prefill(batch_store, rows)
    assert isinstance(plan.mask, str) == (shapes is SAME)
    assert plan.inputs.shape == (len(shapes), max(n for _, _, n in shapes))
    logits = model(plan.inputs, cache=batch_prefill_caches(plan, tiny_loaded.kv_geometry().num_layers))
    mx.eval(logits, rows[0].alloc.segment.arrays())

    for i, (_, done, n) in enumerate(shapes):
        np.testing.assert_allclose(np.array(logits[i, :n]), np.array(alone[i]), rtol=1e-4, atol=1e-4)
        # the pool holds the same K/V at the row's positions (and padding wrote nowhere)
        a, b = alone_store.get(f"a{i}"), batch_store.get(f"b{i}")
        for layer in (0, len(a.segment.keys) - 1):
            ka = _gather(alone_store, a, layer, done + n)
            kb = _gather(batch_store, b, layer, done + n)
            np.testing.assert_allclose(kb, ka, rtol=1e-4, atol=1e-5)


def test_a_ragged_calls_mask_is_additive_in_the_pools_dtype(tiny_loaded):
    """A boolean mask is broadcast to every query head and, on CUDA, materialised that
    way in each layer: 27.4 GB over one attention call at three rows of 2,048 tokens over
    34,816 on the H200, against 256 bytes for the additive mask (docs/throughput.md).
    The plan's mask is the additive one: 0 where the boolean rule allows a key, -inf
    elsewhere, [B, 1, T, L], in the pool's (the queries') dtype."""
    store = _store(tiny_loaded)
    rows, starts, ends = [], [], []
    for i, (p, done, n) in enumerate(ROWS):
        alloc = store.reserve(f"m{i}", p + 8)
        store.advance(f"m{i}", done)
        rows.append(PrefillRow(alloc, tuple(_prompt(i, n))))
        starts.append(done)
        ends.append(done + n)
    plan = plan_prefill(store, rows)
    assert not isinstance(plan.mask, str)
    t, width = max(n for _, _, n in ROWS), max(ends)
    assert plan.mask.shape == (len(ROWS), 1, t, width)
    assert plan.mask.dtype == rows[0].alloc.segment.keys[0].dtype
    q = np.arange(t)[None, :, None]
    k = np.arange(width)[None, None, :]
    allowed = (k <= np.asarray(starts)[:, None, None] + q) & (k < np.asarray(ends)[:, None, None])
    mask = np.array(plan.mask[:, 0])
    assert (mask[allowed] == 0).all()
    assert np.isneginf(mask[~allowed]).all()


def _gather(store: KVStore, alloc, layer: int, n: int) -> np.ndarray:
    bs = store.block_size
    slots = [alloc.table[j // bs] * bs + j % bs for j in range(n)]
    return np.array(alloc.segment.keys[layer][mx.array(slots)])


@pytest.mark.parametrize("prefill_batch", [1, 8])
def test_the_runner_puts_a_steps_chunks_in_one_call_per_segment(tiny_loaded, prefill_batch):
    model = tiny_loaded.model
    install_attention_hook(model)
    store = _store(tiny_loaded)
    runner = Runner(model, store, prefill_batch=prefill_batch)
    seqs = []
    for i, (p, _, _) in enumerate(ROWS):
        seq = Sequence(EngineRequest(f"r{i}", tuple(_prompt(7 + i, p)), 4, SamplingParams()))
        store.reserve(seq.request_id, seq.final_len)
        seqs.append(seq)
    calls = runner.prefill([(s, min(s.remaining_prefill, 50)) for s in seqs])
    assert calls == (1 if prefill_batch > 1 else len(ROWS))
    assert [store.get(s.request_id).length for s in seqs] == [min(s.prompt_len - 1, 50) for s in seqs]


@pytest.mark.parametrize("bucket", [0, 64])
@pytest.mark.parametrize("shapes", [ROWS, SAME], ids=["ragged", "same"])
def test_each_row_attends_exactly_its_own_keys(shapes, bucket):
    """Attention itself on random K/V of real magnitude: the tiny model's logits hardly
    move when a query sees a few keys more or less, so its logit tests cannot catch a mask
    that lets a row see another position's keys. Each row's real queries, under the call's
    mask over its gathered keys (padded to a bucket or not), must give what its own keys
    give under SDPA's causal mask."""
    geometry = KVGeometry(1, 2, 32, mx.float32)
    store = KVStore(geometry, segment_tokens=1024, key_bucket=bucket)
    rng = np.random.default_rng(len(shapes) + bucket)
    keys = {i: [mx.array(rng.standard_normal((1, 2, p, 32)).astype(np.float32)) for _ in range(2)]
            for i, (p, _, _) in enumerate(shapes)}
    rows = []
    for i, (p, done, n) in enumerate(shapes):
        alloc = store.reserve(f"r{i}", p)
        k, v = keys[i]
        if done:
            prefill_caches(store, alloc, done)[0].update_and_fetch(k[:, :, :done], v[:, :, :done])
            mx.eval(alloc.segment.arrays())
            store.advance(f"r{i}", done)
        rows.append(PrefillRow(alloc, tuple(range(n))))
    plan = plan_prefill(store, rows)
    t = plan.inputs.shape[1]
    chunk_k, chunk_v = (
        mx.concatenate([mx.pad(keys[i][j][:, :, done:done + n], [(0, 0), (0, 0), (0, t - n), (0, 0)])
                        for i, (_, done, n) in enumerate(shapes)])
        for j in range(2))
    cache = batch_prefill_caches(plan, 1)[0]
    got_k, got_v = cache.update_and_fetch(chunk_k, chunk_v)
    q = mx.array(rng.standard_normal((len(shapes), 4, t, 32)).astype(np.float32))
    got = np.array(mx.fast.scaled_dot_product_attention(q, got_k, got_v, scale=0.2, mask=cache.make_mask(t)))
    for i, (_, done, n) in enumerate(shapes):
        k, v = (a[:, :, : done + n] for a in keys[i])
        want = mx.fast.scaled_dot_product_attention(q[i : i + 1, :, :n], k, v, scale=0.2, mask="causal")
        np.testing.assert_allclose(got[i, :, :n], np.array(want)[0], rtol=1e-5, atol=1e-5)
