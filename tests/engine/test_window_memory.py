"""A sliding-window model's memory on mlx-lm's own caches (`--no-paged-windows`): the bytes
admission reserves for a long request, and the bytes load admission counts for it, are what
its caches hold (window layers at their window), checked against the caches' own arrays step
by step on a real engine. The paged store's rings: tests/engine/test_window_store.py."""

from __future__ import annotations

import random
from collections.abc import Callable

import mlx.core as mx

from engine import EngineRequest, LoadedModel, SamplingParams
from engine.dense import DenseStore
from memory import MemoryGuard, estimate_prefill
from memory.probes.allocator import AllocatorProbe
from memory.walk import EngineParams, walk_single_request
from tests.engine import window_model
from tests.engine.conftest import Harness

STEP = 32  # prefill chunk


def test_a_long_request_is_reserved_and_load_admitted_at_what_its_caches_hold(
    make_engine: Callable[..., Harness], window_loaded: LoadedModel
) -> None:
    prompt_tokens, new_tokens = 1500, 8  # 23 windows of prompt, in 47 chunks
    total = prompt_tokens + new_tokens
    guard = MemoryGuard(AllocatorProbe())
    h = make_engine(guard=guard, loaded=window_loaded, paged_windows=False, prefill_step_size=STEP,
                    prefix_cache_bytes=0)
    store = h.core.store
    assert isinstance(store, DenseStore)
    reserved = window_model.reserved_kv_bytes(total, STEP)
    all_full = window_model.all_full_kv_bytes(total)
    assert reserved < all_full / 2

    # load admission's arithmetic (memory.walk, what `serve` and `doctor` run before the
    # weights load) holds the request at the same bytes as the engine's store
    walk = walk_single_request(
        window_loaded.geometry, prompt_tokens=prompt_tokens, max_tokens=new_tokens,
        usage_bytes=0, ceiling_bytes=1 << 40, params=EngineParams(chunk_tokens=STEP, paged_windows=False),
    )
    assert walk.admitted and walk.reserved_bytes == walk.kv_bytes == reserved

    prompt = tuple(random.Random(5).randrange(256) for _ in range(prompt_tokens))
    h.submit(EngineRequest("long", prompt, new_tokens, SamplingParams(temperature=0.0)))
    peak_held = steps = 0
    while "long" not in h.out.finished:
        seq = next((s for s in [*h.core.waiting, *h.core.prefilling, *h.core.batch.seqs]
                    if s.request_id == "long"), None)
        processed = seq.processed if seq is not None else 0
        before = store.request_bytes()
        h.step()
        held = store.request_bytes()  # the caches' arrays, read back from MLX
        mx.eval([c.state for c in store._caches()])
        if store.requests:
            steps += 1
            # the guard was asked for this reservation, and the store reports it
            assert store.reserved_bytes() == h.core.admission.reservation_bytes(
                [s for s in [*h.core.prefilling, *h.core.batch.seqs]]) == reserved
            assert h.core.stats.kv_reserved_bytes == reserved
            assert held <= reserved
            if processed < prompt_tokens - 1 and held > before:  # a prefill chunk ran
                chunk = min(STEP, prompt_tokens - 1 - processed)
                estimate = estimate_prefill(window_loaded.geometry, chunk_tokens=chunk,
                                            context_tokens=processed)
                assert held - before <= estimate.kv_growth_bytes
        peak_held = max(peak_held, held)
    assert steps >= prompt_tokens // STEP
    # tight: the reservation is the peak the caches reached, up to the window layers'
    # chunk that only a prefill holds and part of the full layers' last 256-token step
    slack = window_model.WINDOW_LAYERS * (STEP - 1) + window_model.FULL_LAYERS * 255
    assert peak_held <= reserved <= peak_held + slack * window_model.BYTES_PER_TOKEN_LAYER
    assert store.requests == {} and store.request_bytes() == 0


def test_rows_of_unequal_lengths_are_reserved_with_the_padding_of_their_merged_batch(
    make_engine: Callable[..., Harness], window_loaded: LoadedModel
) -> None:
    """A short request decoding beside a long one is left-padded to the long one's length
    on the full layers of the merged batch: what the two hold together is more than their
    own reservations, and admission counts it."""
    h = make_engine(loaded=window_loaded, paged_windows=False, prefill_step_size=STEP, prefix_cache_bytes=0)
    store = h.core.store
    assert isinstance(store, DenseStore)
    rng = random.Random(1)
    shapes = {"short": (40, 300), "long": (1500, 100)}
    for rid, (prompt, new) in shapes.items():
        prompt_ids = tuple(rng.randrange(256) for _ in range(prompt))
        h.submit(EngineRequest(rid, prompt_ids, new, SamplingParams(temperature=0.0)))
    finals = [p + n for p, n in shapes.values()]
    own = sum(window_model.reserved_kv_bytes(n, STEP) for n in finals)
    padding = window_model.FULL_LAYERS * (max(finals) - min(finals)) * window_model.BYTES_PER_TOKEN_LAYER
    peak_held = both_rows = 0
    while len(h.out.finished) < 2:
        h.step()
        admitted = [*h.core.prefilling, *h.core.batch.seqs]
        held = store.request_bytes()
        assert held <= store.reserved_bytes() == h.core.admission.reservation_bytes(admitted)
        assert h.core.stats.kv_reserved_bytes == store.reserved_bytes()
        if len(store.rows) == 2:
            both_rows += 1
            assert store.reserved_bytes() == own + padding
            peak_held = max(peak_held, held)
    assert both_rows >= 50
    assert peak_held > own  # the padding is real: their own reservations alone undercount
    assert store.reserved_bytes() == 0
