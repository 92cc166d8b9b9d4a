"""Hybrids in the paged store (engine.kv.state): attention layers in blocks, recurrent state
beside them, on tiny random float32 models with mlx-lm's own layers (qwen3_next: gated
delta-net; lfm2: short convolutions; bailing_hybrid: MLA attention through the gather path).

A prompt sharing a long head with an earlier one resumes where a snapshot of the state was
kept (a prefill checkpoint, an earlier prompt's end, a conversation's end) and prefills
only the rest; every answer is token-identical to mlx-lm's `generate_step`, alone and
batched; admission counts each sequence's state and each snapshot."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine import EngineRequest, SamplingParams
from engine.kv import KVStore
from engine.kv.state import StateRows
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


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_shared_long_prefix_resumes_from_a_checkpoint_alone_and_batched(
    name: str, make_engine: Callable[..., Harness]
) -> None:
    loaded = tiny_archs.loaded(name)
    h = make_engine(loaded=loaded, prefill_step_size=STEP)
    store = h.core.store
    assert isinstance(store, KVStore) and store.geometry.states and isinstance(h.core.batch.states, StateRows)
    first = _tokens(1, 300)
    assert _run(h, [EngineRequest("first", first, 6, GREEDY)]) == len(first) - 1
    assert h.out.tokens["first"] == _reference(loaded.model, first, 6)

    # 230 tokens in common: the checkpoint at 192 is the furthest state of a prefix of it
    second = first[:230] + _tokens(2, 90)
    prefilled = _run(h, [EngineRequest("second", second, 8, GREEDY)])
    assert h.out.cached["second"] == 192 and prefilled == len(second) - 1 - 192
    assert h.out.tokens["second"] == _reference(loaded.model, second, 8)

    # beside two other prompts, one of which shares the head too
    third = first[:150] + _tokens(3, 40)
    other = _tokens(4, 70)
    batch = [EngineRequest("second-again", second, 8, GREEDY), EngineRequest("third", third, 7, GREEDY),
             EngineRequest("other", other, 9, GREEDY)]
    prefilled = _run(h, batch)
    assert h.out.cached["second-again"] == len(second) - 1  # its prompt's end
    assert h.out.cached["third"] == 128 and h.out.cached["other"] == 0
    assert prefilled == (len(third) - 1 - 128) + (len(other) - 1)
    assert h.core.batch.max_batch_seen >= 2
    assert h.out.tokens["second-again"] == h.out.tokens["second"]
    assert h.out.tokens["third"] == _reference(loaded.model, third, 7)
    assert h.out.tokens["other"] == _reference(loaded.model, other, 9)
    assert store.requests == {} and h.core.batch.states.own == {} and h.core.batch.states.batch is None


@pytest.mark.parametrize("name", HYBRIDS)
def test_an_agent_conversation_resumes_from_the_whole_previous_turn(
    name: str, make_engine: Callable[..., Harness]
) -> None:
    """Each turn sends the previous prompt, the model's answer and new text: the state kept
    when the previous turn ended holds all of it, so only the new text is prefilled."""
    loaded = tiny_archs.loaded(name)
    h = make_engine(loaded=loaded, prefill_step_size=STEP)
    tokens = _tokens(10, 90)
    previous = 0
    for turn in range(4):
        rid = f"turn{turn}"
        prefilled = _run(h, [EngineRequest(rid, tokens, 12, GREEDY)])
        assert h.out.cached[rid] == previous, turn
        assert prefilled == len(tokens) - 1 - previous
        answer = h.out.tokens[rid]
        assert answer == _reference(loaded.model, tokens, 12), turn
        previous = len(tokens) + len(answer)
        tokens = (*tokens, *answer, *_tokens(100 + turn, 25))


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
