"""Prefill keys padded to lengths from a small set (engine.kv.buckets) change no token.

On CUDA each new key length cost MLX's fused attention a plan of its own; the store pads a
prefill call's keys with masked filler instead. On the CPU the padding is off by default,
so these tests turn it on with a small bucket and compare against the unpadded engine on
the tiny model: the same tokens and logprobs, alone and batched, and admission predicting
the padded keys it will run.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from engine import EngineRequest, SamplingParams
from engine.kv import KVGeometry, KVStore, install_attention_hook, prefill_caches
from engine.kv.buckets import (
    CUDA_KEY_BUCKET,
    CUDA_PLAN_MS,
    PLANNED_SHAPES,
    QUERY_FLOOR,
    QUERY_QUANTUM,
    KeyLengths,
    default_key_bucket,
    padded_keys,
)
from engine.kv.prefill import PrefillRow, batch_prefill_caches, plan_prefill
from engine.step_budget import StepBudget

SHAPES = [(13, 9), (300, 17), (45, 5), (128, 24), (7, 12), (260, 3), (90, 20), (33, 15)]


def test_padded_lengths_are_powers_of_two_then_multiples_of_the_bucket() -> None:
    assert [padded_keys(n, 0) for n in (1, 300, 5000)] == [1, 300, 5000]
    assert [padded_keys(n, 4096) for n in (1, 256, 257, 2048, 2049, 4096, 4097, 100_000)] == [
        256, 256, 512, 2048, 4096, 4096, 8192, 102_400]
    assert [padded_keys(n, 64) for n in (1, 64, 65, 300)] == [64, 64, 128, 320]
    assert len({padded_keys(n, 4096) for n in range(1, 100_001, 256)}) == 29  # 4 small + 25
    assert [default_key_bucket(b) for b in ("cuda", "metal", "cpu")] == [4096, 0, 0]


def _store(loaded, bucket: int) -> KVStore:
    g = loaded.kv_geometry()
    return KVStore(KVGeometry(g.num_layers, g.num_kv_heads, g.head_dim, g.dtype), segment_tokens=4096,
                   key_bucket=bucket)


def _keys_read(cache, tokens: int) -> int:
    """How many keys a layer's SDPA sees for a chunk of `tokens` written through `cache`."""
    pool = cache.segment.keys[0]
    chunk = mx.zeros((1, pool.shape[1], tokens, pool.shape[2]), pool.dtype)
    keys, _ = cache.update_and_fetch(chunk, chunk)
    return keys.shape[2]


def _prefill(model, store: KVStore, rid: str, prompt: list[int], chunk: int) -> list[mx.array]:
    alloc = store.reserve(rid, len(prompt))
    out = []
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        caches = prefill_caches(store, alloc, len(piece))
        out.append(model(mx.array(piece)[None], cache=caches)[0])
        mx.eval(out[-1], alloc.segment.arrays())
        store.advance(rid, len(piece))
    return out


def test_a_padded_prefill_gives_the_unpadded_logits_and_kv(tiny_loaded) -> None:
    model = tiny_loaded.model
    assert install_attention_hook(model)
    prompt = [random.Random(7).randrange(0, 256) for _ in range(200)]
    plain, padded = _store(tiny_loaded, 0), _store(tiny_loaded, 64)
    a = _prefill(model, plain, "a", prompt, 48)
    b = _prefill(model, padded, "b", prompt, 48)
    caches = prefill_caches(padded, padded.reserve("c", 100), 70)
    assert _keys_read(caches[0], 70) == 128  # 70 keys read as 128
    assert caches[0].make_mask(70).shape == (1, 1, 70, 128)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.array(y), np.array(x), rtol=1e-4, atol=1e-4)
    for store, rid in ((plain, "a"), (padded, "b")):  # every position's K, in order
        alloc = store.get(rid)
        slots = [alloc.table[p // 16] * 16 + p % 16 for p in range(200)]
        keys = np.array(alloc.segment.keys[0])[slots]
        if rid == "a":
            expected = keys
    np.testing.assert_allclose(keys, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("start", [0, 40, 64])
def test_a_padded_chunk_attends_exactly_its_own_keys(start: int) -> None:
    """Attention itself, on random K/V of real magnitude (the tiny model's logits hardly
    move when a query sees a few keys more or less): the padded keys under the cache's
    mask give what the unpadded keys give under SDPA's causal mask."""
    geometry = KVGeometry(1, 2, 32, mx.float32)
    plain = KVStore(geometry, segment_tokens=512)
    padded = KVStore(geometry, segment_tokens=512, key_bucket=64)
    rng = np.random.default_rng(start)
    k, v = (mx.array(rng.standard_normal((1, 2, start + 24, 32)).astype(np.float32)) for _ in range(2))
    q = mx.array(rng.standard_normal((1, 4, 24, 32)).astype(np.float32))
    outs = []
    for store in (plain, padded):
        alloc = store.reserve("r", start + 24)
        if start:
            prefill_caches(store, alloc, start)[0].update_and_fetch(k[:, :, :start], v[:, :, :start])
            store.advance("r", start)
        cache = prefill_caches(store, alloc, 24)[0]
        keys, values = cache.update_and_fetch(k[:, :, start:], v[:, :, start:])
        mask = cache.make_mask(24)
        assert (keys.shape[2], mask) == (start + 24, "causal") if store is plain else keys.shape[2] % 64 == 0
        outs.append(np.array(mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2, mask=mask)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_a_padded_batched_call_gives_each_row_its_unpadded_logits(tiny_loaded) -> None:
    model = tiny_loaded.model
    assert install_attention_hook(model)
    layers = tiny_loaded.kv_geometry().num_layers
    shapes = [(70, 0, 70), (150, 64, 60), (120, 64, 60)]  # ragged, then one shape (padded: a mask)
    results = []
    for bucket in (0, 64):
        store = _store(tiny_loaded, bucket)
        rows = []
        for i, (p, done, n) in enumerate(shapes):
            prompt = [random.Random(i).randrange(0, 256) for _ in range(p)]
            alloc = store.reserve(f"r{i}", p)
            if done:
                model(mx.array(prompt[:done])[None], cache=prefill_caches(store, alloc, done))
                mx.eval(alloc.segment.arrays())
                store.advance(f"r{i}", done)
            rows.append(PrefillRow(alloc, tuple(prompt[done:done + n])))
        for part in (rows[:1], rows[1:]):
            plan = plan_prefill(store, part)
            if bucket:
                assert not isinstance(plan.mask, str) and plan.read.shape[-1] % 64 == 0
            logits = model(plan.inputs, cache=batch_prefill_caches(plan, layers))
            mx.eval(logits)
            results.append(np.array(logits))
    for x, y in zip(results[:2], results[2:], strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4)


def _requests() -> list[EngineRequest]:
    return [
        EngineRequest(f"p{i}", tuple(random.Random(900 + i).randrange(0, 256) for _ in range(n)), m,
                      SamplingParams(temperature=0.0, logprobs=True))
        for i, (n, m) in enumerate(SHAPES)
    ]


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_the_engine_with_padded_keys_gives_the_same_tokens(make_engine, batched: bool) -> None:
    outputs = []
    for bucket in (0, 64):
        config = dict(prefill_step_size=64, prefix_cache_bytes=0, prefill_key_bucket=bucket,
                      prefill_plan_ms=1e9)
        got: dict[str, tuple[list[int], list[float]]] = {}
        if batched:
            h = make_engine(max_step_tokens=160, max_concurrency=16, prefill_batch=8, **config)
            for req in _requests():
                h.submit(req)
            h.run_until(lambda h=h: len(h.out.finished) == len(SHAPES))
            assert h.core.stats.prefill_calls < h.core.stats.prefill_chunks  # rows shared calls
            got = {r: (h.out.tokens[r], h.out.logprobs[r]) for r in h.out.finished}
        else:
            for req in _requests():
                h = make_engine(**config)
                h.submit(req)
                h.run_until(lambda r=req.request_id, h=h: r in h.out.finished)
                got[req.request_id] = (h.out.tokens[req.request_id], h.out.logprobs[req.request_id])
        assert h.core.store.key_bucket == bucket
        outputs.append(got)
    plain, padded = outputs
    for rid, (tokens, logprobs) in plain.items():
        assert padded[rid][0] == tokens, rid
        assert padded[rid][1] == pytest.approx(logprobs, abs=1e-4), rid


def test_admission_predicts_the_padded_keys(make_engine) -> None:
    """A chunk that attends padded keys is predicted as one over those keys, with its mask."""
    plain = make_engine(prefix_cache_bytes=0)
    padded = make_engine(prefix_cache_bytes=0, prefill_key_bucket=4096, prefill_plan_ms=1e9)
    for h in (plain, padded):
        h.submit(EngineRequest("x", tuple(range(200)), 1, SamplingParams(temperature=0.0)))
    seq_plain = plain.core.waiting[0] if plain.core.waiting else plain.core.prefilling[0]
    seq_padded = padded.core.waiting[0] if padded.core.waiting else padded.core.prefilling[0]
    assert padded.core.admission.chunk_prediction(seq_padded, 200) > plain.core.admission.chunk_prediction(
        seq_plain, 200)


def test_a_cut_chunk_is_a_multiple_of_the_quantum_where_keys_are_padded() -> None:
    budget = StepBudget(0.1, floor_tokens=32, quantum_tokens=QUERY_QUANTUM)
    budget.observe_prefill([(0, 1000)], 0.1)  # 100 µs a token
    budget.observe_step(0.02, 0.0)  # a decode step of 20 ms leaves 80 ms: 800 tokens
    budget.begin(decoding=True)
    assert budget.allow(0, 4096) == 768
    budget.begin(decoding=True)
    assert budget.allow(0, 700) == 700  # the token budget's own cut stays as it is
    plain = StepBudget(0.1, floor_tokens=32)
    plain.observe_prefill([(0, 1000)], 0.1)
    plain.observe_step(0.02, 0.0)
    plain.begin(decoding=True)
    assert plain.allow(0, 4096) == 800


def test_a_cut_chunk_is_never_below_the_query_floor_where_keys_are_padded(make_engine) -> None:
    """Where keys are padded (CUDA), attention over a long context costs a 128-query chunk
    about what it costs a 512-query one: the budget cuts no chunk below QUERY_FLOOR."""
    padded = make_engine(prefix_cache_bytes=0, prefill_key_bucket=4096, max_decode_stall_s=0.1)
    plain = make_engine(prefix_cache_bytes=0, max_decode_stall_s=0.1)
    assert padded.core.step_budget.floor_tokens == QUERY_FLOOR
    assert plain.core.step_budget.floor_tokens == plain.core.config.min_chunk_tokens < QUERY_FLOOR
    budget = padded.core.step_budget
    budget.observe_prefill([(60_000, 32)], 0.09)  # 32 tokens deep in a long prompt took 90 ms
    budget.observe_step(0.1, 0.09)  # beside a decode step of 10 ms
    budget.begin(decoding=True)
    assert budget.allow(60_032, 4096) == QUERY_FLOOR


def test_no_later_chunk_of_a_step_runs_below_the_floor() -> None:
    """What a step's time leaves after its first chunk, if less than the floor, waits for the
    next step: a second call of 32 tokens would cost about what one of 512 costs."""
    budget = StepBudget(0.1, floor_tokens=QUERY_FLOOR, quantum_tokens=QUERY_QUANTUM)
    budget.observe_prefill([(0, 1000)], 0.1)  # 100 µs a token
    budget.observe_step(0.02, 0.0)  # 80 ms left: 800 tokens, cut to 768
    budget.begin(decoding=True)
    assert budget.allow(0, 4096) == 768
    budget.spend(0, 768)  # 3.2 ms left: 32 tokens
    assert budget.allow(768, 4096 - 768) == 0


def test_padding_is_chosen_only_where_it_costs_less_than_a_plan() -> None:
    """Llama-3-8B's attention (32 heads of 128, 32 layers) on CUDA: a small chunk or a short
    context pads its keys (a new plan would cost more than the mask); a 4,096-token chunk
    deep in a long prompt attends its exact keys, causal; a shape that ran exactly before
    is exact for free; and rows of one shape count as one call of all their queries."""
    lengths = KeyLengths(CUDA_KEY_BUCKET, pair_flops=4 * 32 * 128 * 32, plan_ms=CUDA_PLAN_MS)
    assert lengths.keys(512, 8192 + 300) == 12_288  # ~7 ms of padding: pad
    assert lengths.keys(4096, 98_304 + 4096 + 300) == 98_304 + 4096 + 300  # ~330 ms of padding: exact
    assert lengths.keys(512, 98_816) == 98_816  # 40 ms (measured 41): exact
    assert lengths.keys(512, 60_000) == 61_440
    assert lengths.keys(8, 98_816, rows=64) == 98_816  # 512 queries in all
    assert lengths.keys(8, 98_816) == lengths.keys(127, 98_816) == 102_400  # a verify step: pads
    lengths.ran(512, 60_000, 60_000)
    assert lengths.keys(512, 60_000) == 60_000 and lengths.keys(512, 60_001) == 61_440
    assert lengths.keys(512, 61_440) == 61_440  # a multiple of the bucket is exact already
    never = KeyLengths(CUDA_KEY_BUCKET, pair_flops=0, plan_ms=CUDA_PLAN_MS)
    assert never.keys(4096, 98_700) == 102_400
    off = KeyLengths(0, pair_flops=4 * 32 * 128 * 32, plan_ms=0.0)
    assert off.keys(4096, 98_700) == 98_700


def test_the_planned_shapes_are_bounded_and_kept_by_use() -> None:
    lengths = KeyLengths(64, pair_flops=1, plan_ms=1e9)
    for end in range(1, 2 * PLANNED_SHAPES + 2, 2):
        lengths.ran(200, end, end)
    assert lengths.keys(200, 1) == 64  # the oldest fell out
    lengths.ran(200, 3, 3)  # used again: the newest
    lengths.ran(200, 1000, 1000)
    assert lengths.keys(200, 3) == 3 and lengths.keys(200, 5) == 64


def test_a_call_that_padding_would_cost_more_attends_its_exact_keys_causally(tiny_loaded) -> None:
    """With padding priced above a plan, the padded store's calls read exactly their keys
    under SDPA's causal mask, alone and as rows of one shape, and give the same logits."""
    model = tiny_loaded.model
    assert install_attention_hook(model)
    prompt = [random.Random(3).randrange(0, 256) for _ in range(400)]
    padded, exact = _store(tiny_loaded, 64), _store(tiny_loaded, 64)
    exact.key_lengths.pair_flops, exact.key_lengths.plan_ms = 10**12, 1.0
    a = _prefill(model, padded, "a", prompt, 150)  # 150 + 150 + 100 tokens
    b = _prefill(model, exact, "b", prompt, 150)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.array(y), np.array(x), rtol=1e-4, atol=1e-4)
    caches = prefill_caches(exact, exact.reserve("c", 150), 150)
    assert _keys_read(caches[0], 150) == 150 and caches[0].make_mask(150) == "causal"
    few = prefill_caches(exact, exact.reserve("d", 100), 100)  # below EXACT_MIN_QUERIES: padded
    assert _keys_read(few[0], 100) == 128 and few[0].make_mask(100).shape == (1, 1, 100, 128)
    rows = []
    for i in range(2):
        alloc = exact.reserve(f"r{i}", 90)
        rows.append(PrefillRow(alloc, tuple(prompt[i:i + 90])))
    plan = plan_prefill(exact, rows)
    assert plan.mask == "causal" and plan.read.shape[-1] == 90
    ragged = plan_prefill(exact, [rows[0], PrefillRow(exact.reserve("r2", 80), tuple(prompt[:80]))])
    assert not isinstance(ragged.mask, str) and ragged.read.shape[-1] == 128  # its mask pads anyway


def test_the_engine_prices_padding_by_the_model_and_admission_predicts_the_exact_keys(make_engine) -> None:
    """The engine gives the store the model's attention work per (query, key) pair and the
    configured plan cost; where padding costs more, admission predicts the unpadded,
    unmasked call that will run, and the tokens are those of the padded engine."""
    padded = make_engine(prefix_cache_bytes=0, prefill_key_bucket=4096, prefill_plan_ms=1e9)
    exact = make_engine(prefix_cache_bytes=0, prefill_key_bucket=4096, prefill_plan_ms=0.0)
    g = exact.core.loaded.geometry
    assert exact.core.store.key_lengths.pair_flops == 4 * g.num_heads * g.head_dim * g.num_layers > 0
    for h in (padded, exact):
        h.submit(EngineRequest("x", tuple(range(200)), 8, SamplingParams(temperature=0.0, logprobs=True)))
    first = [h.core.waiting[0] if h.core.waiting else h.core.prefilling[0] for h in (padded, exact)]
    assert padded.core.admission.chunk_prediction(first[0], 200) > exact.core.admission.chunk_prediction(
        first[1], 200)
    for h in (padded, exact):
        h.run_until(lambda h=h: "x" in h.out.finished)
    assert exact.out.tokens["x"] == padded.out.tokens["x"]
    assert exact.out.logprobs["x"] == pytest.approx(padded.out.logprobs["x"], abs=1e-4)


def test_a_shape_is_planned_ahead_where_the_unhidden_plan_costs_less_than_padding() -> None:
    """Llama-3-8B's attention on CUDA, a plan of 65.5 ms: a 512-token chunk of 35 ms at 8k
    of context would leave 30 ms of the plan unhidden against about 11 ms of padding and
    bucket plans (pad); one of 57 ms at 41k, 8.5 ms against 25 (plan ahead); a chunk as
    long as the plan always hides it; nothing is planned where shapes are not."""
    lengths = KeyLengths(CUDA_KEY_BUCKET, pair_flops=4 * 32 * 128 * 32, plan_ms=65.5)
    assert not lengths.ahead_pays(512, 8192 + 1024, busy_ms=35.0)
    assert lengths.ahead_pays(512, 40_960 + 1024, busy_ms=57.0)
    assert lengths.ahead_pays(512, 8192 + 1024, busy_ms=65.5)
    assert not KeyLengths(0, pair_flops=1, plan_ms=65.5).ahead_pays(512, 50_000, busy_ms=100.0)
    assert not KeyLengths(CUDA_KEY_BUCKET, pair_flops=1, plan_ms=0.0).ahead_pays(512, 50_000, busy_ms=100.0)
