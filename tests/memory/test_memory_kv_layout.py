"""memory.estimate.KVLayout: sequences sized as mlx-lm's caches hold them, by kind (full,
window, chunked, state), in the load walk and the prefill estimate; a geometry without a
layout (every layer full) is sized as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memory import KVGroup, KVLayout, ModelGeometry, estimate_prefill, kv_cache_bytes
from memory.estimate import CHUNKED, FULL, STATE, WINDOW, cache_slots
from memory.walk import EngineParams, reservation_bytes, store_bytes, walk_single_request

# Gemma 3 270M's shape: 18 layers, 15 of them with a 512-token window, 1 KV head of 256, bf16
PER_LAYER = 2 * 1 * 256 * 2
GEMMA = ModelGeometry(num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256, hidden_size=640,
                      intermediate_size=2048, vocab_size=262144, dtype_bytes=2)
GEMMA_LAYOUT = KVLayout((KVGroup(WINDOW, 15, 15 * PER_LAYER, window=512),
                         KVGroup(FULL, 3, 3 * PER_LAYER)))
GEMMA_WINDOWED = replace(GEMMA, kv_layout=GEMMA_LAYOUT)
PARAMS = EngineParams(chunk_tokens=512)


@pytest.mark.parametrize(
    ("kind", "tokens", "window", "chunk", "merged", "slots"),
    [
        (FULL, 0, None, 0, True, 0),
        (FULL, 300, None, 0, False, 512),  # a cache of its own: 256-token steps
        (FULL, 300, None, 0, True, 555),  # merged at its length, then 256 at a time
        (FULL, 512, None, 0, True, 767),
        (WINDOW, 100, 512, 0, True, 256),  # below the window: decode's steps
        (WINDOW, 8192, 512, 0, True, 512),
        (WINDOW, 8192, 512, 512, True, 1023),  # a prefill chunk beside window - 1 kept
        (WINDOW, 600, 512, 512, True, 600),
        (CHUNKED, 8192, 1024, 512, False, 1536),
        (CHUNKED, 100, 1024, 512, False, 256),
        (STATE, 8192, None, 512, True, 0),
    ],
)
def test_slots_by_kind(kind: str, tokens: int, window: int | None, chunk: int, merged: bool,
                       slots: int) -> None:
    assert cache_slots(kind, tokens, window, chunk, merged=merged) == slots


def test_a_long_request_on_a_window_model_reserves_window_sized_kv_on_its_window_layers() -> None:
    tokens = 65536
    expected = 3 * (tokens + 255) * PER_LAYER + 15 * (512 + 512 - 1) * PER_LAYER
    assert GEMMA_LAYOUT.bytes_for(tokens, 512) == expected
    assert reservation_bytes(GEMMA_WINDOWED, [tokens], PARAMS) == expected
    assert reservation_bytes(GEMMA, [tokens], PARAMS) == 18 * tokens * PER_LAYER  # all full
    assert expected < reservation_bytes(GEMMA, [tokens], PARAMS) / 5
    # mlx-lm's own caches have no segments: n requests hold n reservations
    assert store_bytes(GEMMA_WINDOWED, 4096, 7, PARAMS) == 7 * GEMMA_LAYOUT.bytes_for(4096, 512)


def test_the_load_walk_holds_the_reserve_at_what_the_caches_hold() -> None:
    walk = walk_single_request(GEMMA_WINDOWED, prompt_tokens=8192, max_tokens=0, usage_bytes=0,
                               ceiling_bytes=1 << 40, params=PARAMS)
    assert walk.admitted and walk.kv_bytes == walk.reserved_bytes == GEMMA_LAYOUT.bytes_for(8192, 512)
    full = walk_single_request(GEMMA, prompt_tokens=8192, max_tokens=0, usage_bytes=0,
                               ceiling_bytes=1 << 40, params=PARAMS)
    assert full.kv_bytes == 18 * 8192 * PER_LAYER  # unchanged for a geometry without a layout


def test_state_layers_hold_a_fixed_size_per_sequence() -> None:
    mamba = replace(GEMMA, kv_layout=KVLayout((KVGroup(STATE, 2, fixed_bytes=10240),)))
    assert kv_cache_bytes(mamba, 100_000) == 10240
    assert reservation_bytes(mamba, [1, 100_000], PARAMS) == 2 * 10240
    chunk = estimate_prefill(mamba, chunk_tokens=512, context_tokens=100_000)
    assert chunk.kv_growth_bytes == 2 * 10240 // 2  # one entry's old and new state at once


def test_a_chunk_deep_in_a_window_models_prompt_grows_its_window_layers_by_the_chunk() -> None:
    deep = estimate_prefill(GEMMA_WINDOWED, chunk_tokens=512, context_tokens=60_000)
    full = estimate_prefill(GEMMA, chunk_tokens=512, context_tokens=60_000)
    # full layers a 256-step per chunk token, window layers the chunk itself; one full
    # layer's old and grown buffers at once
    permanent = 3 * PER_LAYER * 512 + 15 * PER_LAYER * 512
    one_layer = (60_160 + 60_000 + 512) * PER_LAYER
    assert deep.kv_growth_bytes == permanent + one_layer
    assert deep.kv_growth_bytes <= full.kv_growth_bytes
    # attention: the full layers still attend over the whole context, plus the window's mask
    assert deep.attention_bytes == full.attention_bytes + 512 * (511 + 512)

    windows_only = replace(GEMMA, kv_layout=KVLayout((KVGroup(WINDOW, 18, 18 * PER_LAYER, window=512),)))
    assert estimate_prefill(windows_only, chunk_tokens=512, context_tokens=60_000).attention_bytes \
        < full.attention_bytes / 50
