"""Quantized KV (engine.kv.quant): the store holds packed rows with their scales and
biases, counts their bytes, and generates what mlx-lm generates with `QuantizedKVCache`.

The tiny model's head_dim is 32, so its group size is 32 (mlx-lm's default of 64 does not
divide it, there as here)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

from engine import EngineRequest, SamplingParams
from engine.kv import KVGeometry, KVStore, decode_caches, plan_decode
from engine.kv.quant import KVQuant
from memory import ModelGeometry

GROUP = 32
PROMPTS = [(5, 24), (70, 20), (23, 28)]  # (prompt tokens, new tokens)


def _prompt(i: int, n: int) -> tuple[int, ...]:
    rng = random.Random(900 + i)
    return tuple(rng.randrange(0, 256) for _ in range(n))


def _mlx_lm_greedy(path: Path, prompt: tuple[int, ...], max_tokens: int, *,
                   cache_bits: int | None = None, **kv: object) -> list[int]:
    """mlx-lm's greedy tokens; `cache_bits`: with a `QuantizedKVCache` from the first token
    on, as the store quantizes; `kv`: `generate_step`'s own kv_bits options."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    model, _ = load(str(path))
    if cache_bits is not None:
        kv["prompt_cache"] = [QuantizedKVCache(group_size=GROUP, bits=cache_bits) for _ in model.layers]
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                          sampler=lambda logits: mx.argmax(logits, axis=-1), **kv)  # type: ignore[arg-type]
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_a_row_round_trips_as_mx_quantize_makes_it(bits: int, dtype: mx.Dtype, group: int) -> None:
    """On the CPU decoding unpacks with elementwise ops: bit for bit `mx.dequantize`."""
    q = KVQuant(bits, group, 128, dtype)
    x = (3 * mx.random.normal((5, 2, 3, 128))).astype(dtype)
    rows = q.encode(x)
    assert rows.dtype == mx.uint32 and rows.shape == (5, 2, 3, q.row_words)
    expected = mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group, bits=bits)
    assert mx.array_equal(q.decode(rows), expected)
    assert mx.array_equal(q.decode(rows[:, :, 1:]), expected[:, :, 1:])  # a strided view of rows


@pytest.mark.parametrize(("bits", "group", "dtype"),
                         [(8, 32, mx.float32), (4, 32, mx.float32), (8, 64, mx.bfloat16),
                          (4, 128, mx.bfloat16), (8, 64, mx.float16)])
def test_the_store_counts_the_bytes_admission_counts(bits: int, group: int, dtype: mx.Dtype) -> None:
    geo = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=128, dtype=dtype,
                     kv_bits=bits, kv_group_size=group)
    model = ModelGeometry(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=128, hidden_size=512,
                          intermediate_size=1024, vocab_size=256, dtype_bytes=dtype.size,
                          kv_bits=bits, kv_group_size=group)
    assert geo.bytes_per_token == model.kv_bytes_per_token
    # values at bits/8 bytes, plus a scale and a bias of the dtype per group
    assert geo.bytes_per_token == 2 * 3 * 2 * (128 * bits // 8 + 2 * (128 // group) * dtype.size)
    store = KVStore(geo, segment_tokens=64)
    store.reserve("a", 40)
    store.advance("a", 33)
    (seg,) = store.segments.values()
    assert seg.nbytes == store.pool_bytes() == 64 * geo.bytes_per_token
    s = store.stats()
    assert (s.reserved_bytes, s.used_bytes) == (48 * geo.bytes_per_token, 33 * geo.bytes_per_token)


def test_a_group_size_that_does_not_divide_head_dim_is_refused() -> None:
    with pytest.raises(ValueError, match=r"group size 64 does not divide the model's head_dim 32.*\[32\]"):
        KVStore(KVGeometry(2, 2, 32, mx.float32, kv_bits=8, kv_group_size=64))


def test_a_model_the_store_does_not_serve_refuses_quantized_kv(make_engine) -> None:
    from tests.engine.tiny_archs import loaded

    with pytest.raises(ValueError, match="quantized KV needs the paged KV store"):
        make_engine(loaded=loaded("mamba2"), kv_bits=8, kv_group_size=GROUP)  # recurrent state only


def test_quantized_writes_happen_in_place() -> None:
    """Encoding makes new rows, never a new pool: 200 decode writes stay far under one layer."""
    geo = KVGeometry(2, 2, 64, mx.float32, kv_bits=4, kv_group_size=GROUP)
    s = KVStore(geo, segment_tokens=8192)
    allocs = [s.reserve(f"r{i}", 1000) for i in range(4)]
    seg = allocs[0].segment
    for a in allocs:
        s.advance(a.request_id, 10)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(200):
        for cache in decode_caches(plan_decode(s, allocs), geo.num_layers):
            k = mx.random.normal((4, 2, 1, 64))
            cache.update_and_fetch(k, k)
        mx.eval(seg.arrays())
        for a in allocs:
            s.advance(a.request_id, 1)
    assert mx.get_peak_memory() - before < seg.keys[0].nbytes // 2


def test_the_engine_holds_and_reports_the_quantized_size(make_engine, tiny_loaded) -> None:
    full = make_engine()
    h = make_engine(kv_bits=8, kv_group_size=GROUP)
    per_token = h.core.store.geometry.bytes_per_token
    # float32 rows of 32 values (128 bytes) become 32 bytes of values + a float32 scale and bias
    assert per_token * 128 == full.core.store.geometry.bytes_per_token * 40
    assert per_token == replace(tiny_loaded.geometry, kv_bits=8, kv_group_size=GROUP).kv_bytes_per_token
    assert h.core.admission.geometry.kv_bytes_per_token == per_token
    h.submit(EngineRequest("a", _prompt(0, 40), 8, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.core.batch.seqs) == 1)
    stats = h.core.stats
    assert stats.kv_bytes_per_token == per_token
    assert stats.kv_pool_bytes == sum(s.nbytes for s in h.core.store.segments.values()) > 0
    assert stats.kv_pool_bytes == h.core.store.segment_blocks * 16 * per_token
    assert stats.kv_reserved_bytes == 3 * 16 * per_token  # 48 tokens: three blocks


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_output_is_mlx_lms_with_a_quantized_cache_alone_and_batched(
        make_engine, tiny_model_path, bits) -> None:
    expected = {f"q{i}": _mlx_lm_greedy(tiny_model_path, _prompt(i, n), m, cache_bits=bits)
                for i, (n, m) in enumerate(PROMPTS)}
    for i, (n, m) in enumerate(PROMPTS):
        h = make_engine(kv_bits=bits, kv_group_size=GROUP, prefix_cache_bytes=0)
        h.submit(EngineRequest(f"q{i}", _prompt(i, n), m, SamplingParams(temperature=0.0)))
        h.run_until(lambda i=i, h=h: f"q{i}" in h.out.finished)
        assert h.out.tokens[f"q{i}"] == expected[f"q{i}"]
    h = make_engine(kv_bits=bits, kv_group_size=GROUP, prefix_cache_bytes=0)
    for i, (n, m) in enumerate(PROMPTS):
        h.submit(EngineRequest(f"q{i}", _prompt(i, n), m, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.out.finished) == len(PROMPTS))
    assert h.core.stats.max_batch == len(PROMPTS)
    assert h.out.tokens == expected


def test_greedy_output_is_mlx_lms_kv_bits_generation_at_8_bits(make_engine, tiny_model_path) -> None:
    """mlx-lm's `generate_step(kv_bits=...)` quantizes after the first prefill call, whose
    prompt tokens attend to one another unquantized (the store quantizes them first); at
    8 bits the tokens agree here all the same (docs/kv-store.md measures how far)."""
    h = make_engine(kv_bits=8, kv_group_size=GROUP, prefix_cache_bytes=0)
    for i, (n, m) in enumerate(PROMPTS):
        h.submit(EngineRequest(f"q{i}", _prompt(i, n), m, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.out.finished) == len(PROMPTS))
    for i, (n, m) in enumerate(PROMPTS):
        assert h.out.tokens[f"q{i}"] == _mlx_lm_greedy(
            tiny_model_path, _prompt(i, n), m, kv_bits=8, kv_group_size=GROUP, quantized_kv_start=0)


def test_a_prefix_hit_on_quantized_kv_gives_the_tokens_of_a_miss(make_engine) -> None:
    shared = _prompt(7, 53)
    first = (*shared, *_prompt(8, 6))
    second = (*shared, *_prompt(9, 11))
    miss = make_engine(kv_bits=4, kv_group_size=GROUP, prefix_cache_bytes=0)
    miss.submit(EngineRequest("b", second, 16, SamplingParams(temperature=0.0)))
    miss.run_until(lambda: "b" in miss.out.finished)

    h = make_engine(kv_bits=4, kv_group_size=GROUP)
    h.submit(EngineRequest("a", first, 4, SamplingParams(temperature=0.0)))
    h.run_until(lambda: "a" in h.out.finished)
    h.submit(EngineRequest("b", second, 16, SamplingParams(temperature=0.0)))
    h.run_until(lambda: "b" in h.out.finished)
    assert h.out.cached["b"] >= 48  # three whole blocks of the shared prompt came from the cache
    assert h.out.tokens["b"] == miss.out.tokens["b"]


def test_speculative_drafts_on_quantized_kv_give_the_tokens_of_plain_decoding(make_engine) -> None:
    """Verification runs drafts through the prefill path: each position attends to the same
    quantized K/V a decode step would read."""
    from engine.speculative import SpeculativeConfig

    rng = random.Random(3)
    text = [rng.randrange(97, 123) for _ in range(60)]
    prompt = tuple(text * 3)  # an echo-heavy prompt, so that drafts are proposed and accepted
    runs = []
    for spec in ({}, {"speculative": SpeculativeConfig("prompt-lookup", num_tokens=4, max_rows=8)}):
        h = make_engine(kv_bits=8, kv_group_size=GROUP, prefix_cache_bytes=0, **spec)
        h.submit(EngineRequest("s", prompt, 48, SamplingParams(temperature=0.0)))
        h.run_until(lambda h=h: "s" in h.out.finished)
        runs.append(h)
    assert runs[1].out.tokens["s"] == runs[0].out.tokens["s"]
    report = runs[1].core.stats.speculative
    assert report is not None and report["accepted_tokens"] > 0


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_layers_take_the_kernel_on_cuda_and_gather_nothing(bits: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's quantized variant decodes each lane's values as it reads them (`python
    -m bench.kernel_check` checks it against the plain path on a GPU): once it is turned on,
    quantized KV takes it on CUDA, full and window layers alike, and admission asks for no
    decode gathers. Off, quantized layers stay on the plain path."""
    from engine.kv import attention
    from engine.kv.decode_transient import decode_gather_bytes

    launched: list[tuple[int | None, KVQuant | None]] = []

    def kernel(q, keys, values, table, lengths, max_length, scale, block_size, *, window=None,
               ring=None, sinks=None, quant=None):
        launched.append((window, quant))
        return mx.zeros(q.shape, q.dtype)

    monkeypatch.setattr(attention, "paged_decode", kernel)
    geometry = KVGeometry(2, 2, 64, mx.float32, windows=(16, None), kv_bits=bits)
    store = KVStore(geometry, segment_tokens=1024, chunk_tokens=16)
    allocs = [store.reserve(f"r{i}", 100) for i in range(2)]
    for alloc in allocs:
        alloc.length = 60
    q = mx.zeros((2, 2, 1, 64))
    assert decode_gather_bytes(store, [100, 100]) > 0  # the CPU: the plain path gathers
    try:
        attention.use_kernel(True)
        for cache in decode_caches(plan_decode(store, allocs), geometry.num_layers):
            attention.decode_attention(q, cache, 0.1)
        assert launched == [] and decode_gather_bytes(store, [100, 100]) > 0  # off by default
        attention.use_quant_kernel(True)
        for cache in decode_caches(plan_decode(store, allocs), geometry.num_layers):
            attention.decode_attention(q, cache, 0.1)
        assert sorted(w or 0 for w, _ in launched) == [0, 16]
        assert all(quant == geometry.quant for _, quant in launched)
        assert decode_gather_bytes(store, [100, 100]) == 0
    finally:
        attention.use_kernel(None)
        attention.use_quant_kernel(False)
