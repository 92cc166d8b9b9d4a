"""Sliding-window layers in the paged store: rings of blocks, bands of keys, snapshots.

A model of full and window layers is held in layer groups (`memory.paged`): full groups a
block per 16 tokens, window groups a ring sized to the window plus the largest chunk. These
tests check attention itself on random K/V (a band off by one is invisible in a tiny
model's logits), what a long request reserves against what load admission computes, and
that a prefix hit resumes from a snapshot of the rings with output identical to mlx-lm's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from engine import EngineRequest, LoadedModel, SamplingParams
from engine.kv import KVGeometry, KVStore, decode_caches, plan_decode, prefill_caches
from engine.kv.attention import decode_attention
from engine.kv.cache import DecodeTables
from engine.speculative import SpeculativeConfig
from memory import MemoryGuard
from memory.paged import group_layers, ring_blocks
from memory.probes.allocator import AllocatorProbe
from memory.walk import EngineParams, walk_single_request
from tests.engine import window_model
from tests.engine.conftest import Harness

STEP = 32  # prefill chunk


def _reference(k: np.ndarray, v: np.ndarray, q: np.ndarray, pos: int, window: int,
               scale: float) -> np.ndarray:
    """Attention of one query at `pos` over keys (pos - window, pos]: [H, D] per kv head."""
    lo = max(0, pos - window + 1)
    scores = np.einsum("hd,thd->ht", q, k[lo : pos + 1]) * scale
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", weights, v[lo : pos + 1])


def test_group_layers_puts_full_layers_in_one_group_and_windows_in_groups_of_its_size() -> None:
    groups = group_layers([8, 8, None, 8, 8, None, 8, 8, 8, 4])
    assert [(g.layers, g.window) for g in groups] == [
        ((2, 5), None), ((9,), 4), ((0, 1), 8), ((3, 4), 8), ((6, 7), 8), ((8,), 8),
    ]
    assert ring_blocks(64, 32, 16) == 6  # 63 + 32 positions in distinct slots


@pytest.mark.parametrize(("kv_bits", "runs"), [(None, False), (8, False), (None, True), (8, True)])
def test_window_layers_attend_their_band_through_a_wrapped_ring(kv_bits: int | None, runs: bool) -> None:
    """Random K/V for 300 positions written through prefill chunks and decode steps into
    rings of 64 slots: every prefill query and every decode row sees exactly its window."""
    window, chunk, heads, dim = 40, 24, 2, 32
    geometry = KVGeometry(3, heads, dim, mx.float32, kv_bits=kv_bits, kv_group_size=32,
                          windows=(window, None, window))
    store = KVStore(geometry, segment_tokens=4096, chunk_tokens=chunk)
    total = 300
    alloc = store.reserve("r", total)
    ring = ring_blocks(window, chunk, 16)  # 4 blocks: 64 slots for 63 positions
    assert [len(t) for t in alloc.tables] == [total // 16 + 1, ring, ring]  # a group per window layer
    rng = np.random.default_rng(0)
    k = rng.standard_normal((total, heads, dim)).astype(np.float32)
    v = rng.standard_normal((total, heads, dim)).astype(np.float32)
    seen_k, seen_v = k, v  # what the store reads back
    if kv_bits is not None:
        quant = geometry.quant
        seen_k = np.array(quant.decode(quant.encode(mx.array(k))))
        seen_v = np.array(quant.decode(quant.encode(mx.array(v))))
    scale = dim ** -0.5
    tol = dict(rtol=1e-4, atol=1e-4)
    pos = 0
    for size in (20, 24, 7, 24, 24, 1, 24, 24):  # prefill chunks past the ring's length
        caches = prefill_caches(store, alloc, size)
        window_cache = caches[0]
        keys, values = window_cache.update_and_fetch(
            mx.array(k[pos : pos + size].transpose(1, 0, 2))[None],
            mx.array(v[pos : pos + size].transpose(1, 0, 2))[None])
        q = rng.standard_normal((1, heads, size, dim)).astype(np.float32)
        mask = window_cache.make_mask(size, window_size=window)
        out = np.array(mx.fast.scaled_dot_product_attention(mx.array(q), keys, values, scale=scale,
                                                            mask=mask))
        for t in range(size):
            want = _reference(seen_k, seen_v, q[0, :, t], pos + t, window, scale)
            np.testing.assert_allclose(out[0, :, t], want, **tol)
        store.advance("r", size)
        pos += size
    while pos < total:  # decode steps, the ring wrapping every 64 positions
        plan = plan_decode(store, [alloc], DecodeTables(runs=runs))  # runs: a view of the ring
        cache = decode_caches(plan, geometry.num_layers)[0]  # the layer the chunks wrote
        assert (cache.groups[0].run_start is not None) == runs
        cache.update_and_fetch(mx.array(k[pos])[None, :, None], mx.array(v[pos])[None, :, None])
        q = rng.standard_normal((1, heads, 1, dim)).astype(np.float32)
        out = np.array(decode_attention(mx.array(q), cache, scale))
        want = _reference(seen_k, seen_v, q[0, :, 0], pos, window, scale)
        np.testing.assert_allclose(out[0, :, 0], want, **tol)
        store.advance("r", 1)
        pos += 1


def test_a_long_request_reserves_rings_on_window_layers_as_load_admission_computes(
    make_engine: Callable[..., Harness], window_loaded: LoadedModel
) -> None:
    prompt_tokens, new_tokens = 1500, 8
    total = prompt_tokens + new_tokens
    h = make_engine(guard=MemoryGuard(AllocatorProbe()), loaded=window_loaded, prefill_step_size=STEP,
                    prefix_cache_bytes=0)
    store = h.core.store
    assert isinstance(store, KVStore) and store.geometry.windowed
    per_layer = window_model.BYTES_PER_TOKEN_LAYER
    full_blocks = -(-total // 16)
    ring = ring_blocks(window_model.WINDOW, STEP, 16)
    groups = len(store.geometry.groups)  # 1 full group of 2 layers, 2 window groups of 2
    assert groups == 3 and store.geometry.block_layers == window_model.FULL_LAYERS
    expected = (full_blocks + (groups - 1) * ring) * 16 * window_model.FULL_LAYERS * per_layer
    assert expected < window_model.all_full_kv_bytes(total) / 2

    walk = walk_single_request(
        window_loaded.geometry, prompt_tokens=prompt_tokens, max_tokens=new_tokens,
        usage_bytes=0, ceiling_bytes=1 << 40,
        # a CPU segment of 2,048 tokens of all layers: 6,144 token slots of 2-layer blocks
        params=EngineParams(chunk_tokens=STEP, kv_segment_tokens=2048 * groups),
    )
    assert walk.admitted and walk.reserved_bytes == expected

    prompt = tuple(random.Random(5).randrange(256) for _ in range(prompt_tokens))
    h.submit(EngineRequest("long", prompt, new_tokens, SamplingParams(temperature=0.0)))
    seen = 0
    while "long" not in h.out.finished:
        h.step()
        if store.requests:
            seen += 1
            assert store.reserved_bytes() == h.core.admission.reservation_bytes(
                [*h.core.prefilling, *h.core.batch.seqs]) == expected
            assert h.core.stats.kv_reserved_bytes == expected
            assert store.pool_bytes() == walk.kv_bytes  # one default-size segment
    assert seen >= prompt_tokens // STEP
    assert store.requests == {} and store.request_bytes() == 0
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), window_loaded.model,
                                                     max_tokens=new_tokens, prefill_step_size=STEP)]
    assert h.out.tokens["long"] == reference


def test_a_prefix_hit_resumes_from_the_rings_snapshot_and_prefills_only_the_rest(
    make_engine: Callable[..., Harness], window_loaded: LoadedModel
) -> None:
    """The second turn of a conversation (the first turn's prompt and answer, then 50 new
    tokens) resumes where the first ended: its window layers from the snapshot taken then.
    A prompt sharing only the first turn's first 100 tokens resumes where the two part: the
    copies the first turn's prefill left at its checkpoints 32, 64 and 128
    (`engine.prefix.checkpoints`) hold every window position before that point."""
    h = make_engine(loaded=window_loaded, prefill_step_size=STEP, prefix_cache_bytes=1 << 26)
    rng = random.Random(9)
    first = tuple(rng.randrange(256) for _ in range(300))

    def reference(prompt: tuple[int, ...], n: int) -> list[int]:
        steps = generate_step(mx.array(prompt), window_loaded.model, max_tokens=n, prefill_step_size=STEP)
        return [int(t) for t, _ in steps]

    def run(rid: str, prompt: tuple[int, ...], n: int) -> tuple[list[int], int]:
        before = h.core._counters["prompt_tokens"]
        h.submit(EngineRequest(rid, prompt, n, SamplingParams(temperature=0.0)))
        h.run_until(lambda: rid in h.out.finished, max_steps=500)
        return h.out.tokens[rid], h.core._counters["prompt_tokens"] - before

    answer, prefilled = run("turn1", first, 12)
    assert answer == reference(first, 12) and prefilled == len(first) - 1  # the last is decode's input
    second = (*first, *answer, *(rng.randrange(256) for _ in range(50)))
    tokens, prefilled = run("turn2", second, 10)
    assert tokens == reference(second, 10)
    cached = h.out.cached["turn2"]  # the whole first turn, up to its last token's KV
    assert len(first) + len(answer) - 1 <= cached <= len(first) + len(answer)
    assert prefilled == len(second) - 1 - cached
    stats = h.core.prefix_cache.stats()
    assert stats.hits >= 1 and stats.bytes > 0

    opening = (*first[:100], *(rng.randrange(256) for _ in range(40)))
    tokens, prefilled = run("other", opening, 6)
    assert tokens == reference(opening, 6)
    assert h.out.cached["other"] == 100 and prefilled == len(opening) - 1 - 100


def test_prompt_lookup_on_window_layers_verifies_drafts_through_the_rings(
    make_engine: Callable[..., Harness], window_loaded: LoadedModel
) -> None:
    """Drafts verified as multi-token calls write into the rings and may be rejected: the
    tokens stay mlx-lm's, alone and beside a second row, past several windows."""
    rng = random.Random(3)
    text = [rng.randrange(97, 123) for _ in range(50)]
    prompts = [tuple(text * 4), tuple(rng.randrange(256) for _ in range(150))]
    lookup = SpeculativeConfig("prompt-lookup", num_tokens=4, max_rows=8)
    h = make_engine(loaded=window_loaded, prefill_step_size=STEP, prefix_cache_bytes=0, speculative=lookup)
    assert h.core.store.chunk_tokens == STEP  # a verify of 5 tokens fits the rings' chunk
    for i, p in enumerate(prompts):
        h.submit(EngineRequest(f"r{i}", p, 100, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.out.finished) == 2, max_steps=2000)
    for i, p in enumerate(prompts):
        steps = generate_step(mx.array(p), window_loaded.model, max_tokens=100, prefill_step_size=STEP)
        assert h.out.tokens[f"r{i}"] == [int(t) for t, _ in steps]
    report = h.core.stats.speculative
    assert report is not None and report["accepted_tokens"] > 0


def test_window_layers_take_the_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's ring and sinks variants ran against the plain path on a GPU (`python -m
    bench.kernel_check`): window layers take the kernel on CUDA by default, as full layers
    do; `use_window_kernel(False)` keeps them on the plain path."""
    from engine.kv import attention

    launched: list[int | None] = []

    def kernel(q, keys, values, table, lengths, max_length, scale, block_size, *, window=None,
               ring=None, sinks=None, quant=None):
        launched.append(window)
        return mx.zeros(q.shape, q.dtype)

    monkeypatch.setattr(attention, "paged_decode", kernel)
    geometry = KVGeometry(2, 2, 32, mx.float32, windows=(16, None))
    store = KVStore(geometry, segment_tokens=1024, chunk_tokens=16)
    alloc = store.reserve("r", 100)
    alloc.length = 60
    q = mx.zeros((1, 2, 1, 32))
    try:
        attention.use_kernel(True)
        for enabled, expected in ((None, [None, 16]), (False, [None])):  # None: the default
            if enabled is not None:
                attention.use_window_kernel(enabled)
            launched.clear()
            caches = decode_caches(plan_decode(store, [alloc]), geometry.num_layers)
            for cache in caches:
                decode_attention(q, cache, 0.1)
            assert sorted(launched, key=lambda w: w or 0) == expected
    finally:
        attention.use_kernel(None)
        attention.use_window_kernel(True)


def test_a_prompt_longer_than_a_segment_is_found_again_whole(
    make_engine: Callable[..., Harness], window_loaded: LoadedModel
) -> None:
    """A request too long for a default segment (6,144 token slots of 2-layer blocks on the
    CPU) gets one sized to it, with room for two copies of its rings beside it: the copy at
    the prompt's end is taken, checkpoints leaving that room free, and the same prompt
    again resumes there."""
    h = make_engine(loaded=window_loaded, prefill_step_size=STEP, prefix_cache_bytes=1 << 26)
    store = h.core.store
    prompt = tuple(random.Random(4).randrange(256) for _ in range(6500))
    out = {}
    for rid in ("first", "again"):
        h.submit(EngineRequest(rid, prompt, 4, SamplingParams(temperature=0.0)))
        h.run_until(lambda rid=rid: rid in h.out.finished, max_steps=2000)
        out[rid] = h.out.tokens[rid]
    assert store.blocks_for(6504) + 12 > store.segment_blocks  # its own segment
    assert out["again"] == out["first"]
    assert h.out.cached["again"] >= len(prompt) - 1 - STEP  # the prompt's end, not a checkpoint


def test_a_disk_tier_asked_for_a_window_model_is_refused_aloud(
    make_engine: Callable[..., Harness], window_loaded: LoadedModel, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its cached blocks are copies of rings, which the disk tier's files do not hold: the
    cache stays in memory, and the log says that --prefix-cache-dir is ignored."""
    with caplog.at_level("WARNING", logger="mlx_headroom.engine"):
        h = make_engine(loaded=window_loaded, prefill_step_size=STEP, prefix_cache_dir=str(tmp_path))
    assert h.core.prefix_cache.disk is None
    assert "--prefix-cache-dir is ignored" in caplog.text and "window layers" in caplog.text


def test_a_prompt_that_just_fits_a_segment_in_use_is_found_again_whole(
    make_engine: Callable[..., Harness], window_loaded: LoadedModel
) -> None:
    """A request that fits the free blocks of a segment in use, but without the room for
    copies of its rings, gets a segment of its own instead: else its prompt's end could not
    be cached, and the same prompt again prefilled from the start (seen with the README's
    Gemma 3 270M: a 4,891-token prompt after a short chat never hit)."""
    h = make_engine(loaded=window_loaded, prefill_step_size=STEP, prefix_cache_bytes=1 << 26)
    store = h.core.store
    assert isinstance(store, KVStore)
    h.submit(EngineRequest("chat", (1, 2, 3, 4, 5), 4, SamplingParams(temperature=0.0)))
    h.run_until(lambda: "chat" in h.out.finished)
    (seg,) = store.segments.values()
    free, spare = seg.blocks.free, store.snapshot_spare()
    length = next(n for n in range(store.segment_blocks * store.block_size, 0, -STEP)
                  if store.request_blocks(n + 4) <= free)
    assert store.request_blocks(length + 4) + spare // 2 > free  # it fits, a copy of its rings would not
    prompt = tuple(random.Random(5).randrange(256) for _ in range(length))
    for rid in ("first", "again"):
        h.submit(EngineRequest(rid, prompt, 4, SamplingParams(temperature=0.0)))
        h.run_until(lambda rid=rid: rid in h.out.finished, max_steps=2000)
    assert h.out.tokens["again"] == h.out.tokens["first"]
    assert h.out.cached["again"] == len(prompt) - 1  # the prompt's end
