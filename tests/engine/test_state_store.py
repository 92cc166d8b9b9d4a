"""Hybrids in the paged store (engine.kv.state): attention layers in blocks, recurrent state
beside them, on the tiny qwen3_next (gated delta-net): admission counts each sequence's
state and each kept snapshot, snapshots are evictable on their own, a prompt resumed off a
boundary still keeps the boundaries it crosses, and speculation is off. The shared-head
and agent-conversation scenarios run on both paths in tests/engine/test_dense_prefix.py."""

from __future__ import annotations

from collections.abc import Callable

from engine import EngineRequest, SamplingParams
from engine.kv import KVStore
from engine.speculative import SpeculativeConfig
from tests.engine import tiny_archs
from tests.engine.conftest import Harness
from tests.engine.prompt_runs import prefilled_by as _run
from tests.engine.prompt_runs import random_tokens as _tokens
from tests.engine.prompt_runs import reference

STEP = 64
GREEDY = SamplingParams(temperature=0.0)
HYBRIDS = ["qwen3_next", "lfm2", "bailing_hybrid"]


def _reference(model: object, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return reference(model, prompt, max_tokens, STEP)


def test_admission_counts_each_sequences_state_and_each_kept_snapshot(
        make_engine: Callable[..., Harness]) -> None:
    h = make_engine(loaded=tiny_archs.loaded("qwen3_next"), prefill_step_size=STEP)
    store, cache = h.core.store, h.core.prefix_cache
    assert isinstance(store, KVStore)
    state = store.geometry.state_bytes
    assert state > 0
    assert store.reservation_bytes(100) == store.request_blocks(100) * store.block_bytes + state
    h.submit(EngineRequest("a", _tokens(1, 200), 40, GREEDY))
    h.run_until(lambda: len(h.core.batch.seqs) == 1)
    (seg,) = store.segments.values()
    cache_only = seg.blocks.used - len(store.get("a").owned())
    assert store.request_bytes() == seg.nbytes - cache_only * store.block_bytes + state
    assert store.growth_bytes(100) == state  # the segment has the blocks: only a state is new
    assert store.reserved_bytes() == len(store.get("a").owned()) * store.block_bytes + state
    assert h.core.stats.kv_state_bytes == state  # /v1/memory's kv.state_bytes
    h.run_until(lambda: "a" in h.out.finished)
    # checkpoints at 64, 128 and 192, the prompt's end and the conversation's end: five states
    assert cache._states == 5 and cache.nbytes == len(cache) * store.block_bytes + 5 * state


def test_speculative_decoding_is_off_for_a_hybrid(make_engine: Callable[..., Harness]) -> None:
    """A rejected draft would leave the state past the accepted tokens: no speculation."""
    h = make_engine(loaded=tiny_archs.loaded("qwen3_next"),
                    speculative=SpeculativeConfig("prompt-lookup", 4, 8))
    assert h.core.batch.speculator is None


def test_kept_states_in_a_live_segment_are_evictable_on_their_own(
        make_engine: Callable[..., Harness]) -> None:
    """A snapshot's state is an allocation of its own: admission can have it back while the
    segment its blocks live in holds a request, in the cache's order (a chain's leaves first)."""
    h = make_engine(loaded=tiny_archs.loaded("qwen3_next"), prefill_step_size=STEP)
    store, cache = h.core.store, h.core.prefix_cache
    assert isinstance(store, KVStore)
    state = store.geometry.state_bytes
    _run(h, [EngineRequest("a", _tokens(1, 200), 8, GREEDY)])
    h.submit(EngineRequest("b", _tokens(2, 50), 200, GREEDY))  # keeps the segment live
    h.run_until(lambda: len(h.core.batch.seqs) == 1)
    assert len(store.segments) == 1 and cache._states == 6  # a's five, b's prompt end
    protect = frozenset(n.key for n in cache._lru.values() if n.state is not None)
    protect = frozenset(k for k in protect if cache._lru[k].end == 49)  # b's own
    assert cache.evictable_bytes(protect) == 5 * state
    assert cache.evict(2 * state, protect) == 2 * state and cache._states == 4
    kept = sorted(n.end for n in cache._lru.values() if n.state is not None)
    assert kept == [49, 64, 128, 192]  # a's deepest went first, as the cache's leaves do


def test_a_prompt_resumed_off_a_boundary_still_keeps_the_boundaries_it_crosses(
        make_engine: Callable[..., Harness]) -> None:
    """State can be kept only where a call ends, so a hybrid's prefill call stops at each
    checkpoint boundary it crosses: a prompt resumed at 108 (the last turn's end) runs its
    64-token chunks as 108-128-172, 172-192-236, ... and keeps 128 and 192, where a third
    prompt sharing its first 200 tokens resumes."""
    loaded = tiny_archs.loaded("qwen3_next")
    h = make_engine(loaded=loaded, prefill_step_size=STEP)
    first = _tokens(20, 100)
    _run(h, [EngineRequest("first", first, 8, GREEDY)])
    second = (*first, *h.out.tokens["first"], *_tokens(21, 150))
    _run(h, [EngineRequest("second", second, 4, GREEDY)])
    assert h.out.cached["second"] == 108
    third = (*second[:200], *_tokens(22, 30))
    prefilled = _run(h, [EngineRequest("third", third, 6, GREEDY)])
    assert h.out.cached["third"] == 192 and prefilled == len(third) - 1 - 192
    assert h.out.tokens["third"] == _reference(loaded.model, third, 6)
    assert h.core.batch.kept == {}
