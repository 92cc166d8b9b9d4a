"""The prefix cache under the memory guard, on the real tiny model: it keeps what the
ceiling leaves room for, admission evicts it (least recently used) before anyone waits,
and a conversation's next turn finds the whole previous one, answer included."""

from __future__ import annotations

import gc
import random

import mlx.core as mx

from engine import EngineRequest, SamplingParams
from memory import MemoryGuard
from memory.ceiling import Tier
from memory.probes.allocator import AllocatorProbe

GREEDY = SamplingParams(temperature=0.0)
SEGMENT = 256  # tokens per KV segment here: one prefix per segment
PROMPT = 200


def prompt(seed: int, n: int = PROMPT) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(0, 256) for _ in range(n))


def guard_with(ceiling: int) -> MemoryGuard:
    return MemoryGuard(AllocatorProbe(), enabled=True, tier=Tier.CUSTOM, custom_ceiling_bytes=ceiling)


def run(h, rid: str, tokens: tuple[int, ...], max_tokens: int = 8) -> int:
    """Run one request to its end; its cached tokens."""
    h.submit(EngineRequest(rid, tokens, max_tokens, GREEDY))
    h.run_until(lambda: rid in h.out.finished)
    assert h.out.finished[rid] == "length", h.out.finished[rid]
    return h.out.cached[rid]


def fresh_memory() -> None:
    gc.collect()
    mx.clear_cache()


def forty_prefixes(make_engine, ceiling_segments: float | None) -> tuple[list[int], dict[str, int], int]:
    """40 distinct prompts, then each again: the cached tokens of the second round, the
    evictions by cause, and a segment's bytes."""
    fresh_memory()
    guard = guard_with(1 << 40)
    h = make_engine(guard, prefill_step_size=256, kv_segment_tokens=SEGMENT, wait_timeout_s=60)
    run(h, "probe", prompt(10_000))  # the engine's first allocations, then one entry
    h.core.prefix_cache.clear()
    fresh_memory()
    segment = SEGMENT * h.core.store.geometry.bytes_per_token
    if ceiling_segments is not None:
        base = guard.snapshot().footprint_bytes
        chunk = h.core.admission.headroom_bytes(PROMPT - 1)  # a prompt's one chunk
        guard.configure(ceiling_bytes=base + int(ceiling_segments * segment) + chunk)
    for i in range(40):
        assert run(h, f"a{i}", prompt(i)) == 0
    assert h.core.prefix_cache.stats().evictions_by_cause["cap"] == 0
    cached = [run(h, f"b{i}", prompt(i)) for i in reversed(range(40))][::-1]
    return cached, h.core.prefix_cache.stats().evictions_by_cause, segment


def test_forty_prefixes_under_a_ceiling_that_holds_thirty_lose_the_first_ones(make_engine):
    cached, evicted, _ = forty_prefixes(make_engine, ceiling_segments=30.5)
    whole = [i for i, c in enumerate(cached) if c >= PROMPT - 16]
    # The second round ran last first: the most recent prompts hit whole; the first ones had
    # been evicted by admission (never by a count: there is no cap), tails first, so some
    # kept their first blocks (partial hits).
    assert whole == list(range(40 - len(whole), 40)), cached
    assert 27 <= len(whole) <= 30, cached
    assert evicted["admission"] > 0 and evicted["cap"] == 0


def test_forty_prefixes_under_a_ceiling_that_holds_all_all_hit(make_engine):
    cached, evicted, _ = forty_prefixes(make_engine, ceiling_segments=None)
    assert all(c >= PROMPT - 16 for c in cached), cached
    assert sum(evicted.values()) == 0


def test_a_growing_conversation_hits_the_previous_prompt_and_answer(make_engine):
    """Each turn sends the previous prompt, the model's answer and a few new tokens: the
    cache holds the answer's blocks too, so at most the last partial block is recomputed."""
    h = make_engine(prefill_step_size=128)
    bs = h.core.store.block_size
    tokens = prompt(1, 100)
    previous = 0  # the last turn's prompt and answer
    for turn in range(6):
        rid = f"turn{turn}"
        cached = run(h, rid, tokens, max_tokens=20)
        assert cached >= previous - bs, (turn, cached, previous)
        answer = h.out.tokens[rid]
        assert len(answer) == 20
        previous = len(tokens) + len(answer)
        tokens = (*tokens, *answer, *prompt(100 + turn, 30))


def test_admission_evicts_prefixes_for_a_request_that_needs_their_memory(make_engine):
    """Cached prefixes fill the room under the ceiling; a long request that would fit on an
    idle server is admitted by evicting them, not made to wait or refused. The counterfactual
    is checked too: the same request, on a cache cleared of its entries under the same
    ceiling, is admitted as well (the ceiling is no smaller than it needs)."""
    fresh_memory()
    guard = guard_with(1 << 40)
    h = make_engine(guard, prefill_step_size=256, kv_segment_tokens=SEGMENT, wait_timeout_s=60)
    run(h, "probe", prompt(10_000))
    h.core.prefix_cache.clear()
    fresh_memory()
    segment = SEGMENT * h.core.store.geometry.bytes_per_token
    base = guard.snapshot().footprint_bytes
    headroom = h.core.admission.headroom_bytes(256)
    guard.configure(ceiling_bytes=base + 12 * segment + 2 * headroom)
    for i in range(10):
        run(h, f"p{i}", prompt(i))
    assert len(h.core.store.segments) == 10  # ten entries, one segment each
    long = prompt(99, 8 * SEGMENT - 100)  # eight segments' worth, in a segment of its own
    assert run(h, "long", long) == 0
    evicted = h.core.prefix_cache.stats().evictions_by_cause
    assert evicted["admission"] > 0
    assert not [d for d in guard.recent_decisions() if d.outcome.value in ("wait", "reject")]
    first = [d for d in guard.recent_decisions() if d.request_id == "long"]
    assert any(d.outcome.value == "evict" for d in first), first
    h.core.prefix_cache.clear()  # no entries to evict: the idle server the request fits on
    fresh_memory()
    assert run(h, "long again", long) == 0
    assert h.core.prefix_cache.stats().evictions_by_cause == evicted  # nothing was evicted for it
    again = [d for d in guard.recent_decisions() if d.request_id == "long again"]
    assert again and all(d.outcome.value == "admit" for d in again), again
    assert {d.limit_bytes for d in again} == {d.limit_bytes for d in first}  # the same ceiling


def test_a_live_segment_full_of_cached_blocks_is_reused_in_place(make_engine):
    """Prefixes fill a segment that a running request keeps alive; a new request finds no
    free blocks there, and the ceiling has no room for another segment: cached blocks in
    that segment are evicted for it, and it is admitted at once."""
    fresh_memory()
    guard = guard_with(1 << 40)
    h = make_engine(guard, prefill_step_size=256, kv_segment_tokens=2048, wait_timeout_s=60)
    h.submit(EngineRequest("live", prompt(500, 40), 400, GREEDY))  # keeps segment 0 alive: 28 blocks
    h.run_until(lambda: len(h.core.batch))
    for i in range(5):  # 19 blocks each: 5 of the segment's 128 stay free
        run(h, f"p{i}", prompt(i, 290), max_tokens=1)
    assert len(h.core.store.segments) == 1
    fresh_memory()
    segment = h.core.store.segments[0].nbytes
    chunk = h.core.admission.headroom_bytes(199)  # its prompt's one chunk
    guard.configure(ceiling_bytes=guard.snapshot().footprint_bytes + chunk + segment // 2)
    waits = len(guard.recent_decisions())
    assert run(h, "new", prompt(77, 200)) == 0  # 13 blocks
    assert len(h.core.store.segments) == 1  # no new segment
    assert h.core.prefix_cache.stats().evictions_by_cause["admission"] > 0
    assert not [d for d in guard.recent_decisions()[waits:] if d.outcome.value in ("wait", "reject")]
    h.abort("live")
    h.step()
