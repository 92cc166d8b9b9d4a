"""The dense path's prefix cache (engine.dense.prefix), on tiny random float32 models with
recurrent state (qwen3_next, lfm2) and sliding windows (gemma3_text), and hybrids' state
snapshots on the paged path (engine.kv.state; qwen3_next, lfm2, bailing_hybrid): a prompt that
shares a long head with an earlier one resumes from a snapshot of its caches and
prefills only the rest, an agent's next turn resumes from the whole previous turn, and
every answer is token-identical to mlx-lm's `generate_step` on the full prompt, alone and
batched. Under a memory ceiling, admission evicts snapshots before anyone waits.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import mlx.core as mx
import pytest

from engine import EngineRequest, SamplingParams
from engine.dense import DensePrefixCache, DenseStore
from engine.kv import KVStore
from memory import MemoryGuard
from memory.ceiling import Tier
from memory.probes.allocator import AllocatorProbe
from tests.engine import tiny_archs
from tests.engine.conftest import Harness
from tests.engine.prompt_runs import prefilled_by as _run
from tests.engine.prompt_runs import random_tokens as _tokens
from tests.engine.prompt_runs import reference

STEP = 64  # prefill chunk, and the checkpoint interval
GREEDY = SamplingParams(temperature=0.0)
# the dense path on recurrent state and windows; hybrids' paged path (MLA attention too)
CASES = [("qwen3_next", "dense"), ("lfm2", "dense"), ("gemma3_text", "dense"),
         ("qwen3_next", "paged"), ("lfm2", "paged"), ("bailing_hybrid", "paged")]


def _reference(model: object, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return reference(model, prompt, max_tokens, STEP)


def _engine(make_engine: Callable[..., Harness], name: str, path: str) -> Harness:
    """The dense path (mlx-lm's caches and snapshots of them), or a hybrid's paged one
    (attention in blocks, state snapshots on the prefix cache's nodes, engine.kv.state)."""
    loaded = tiny_archs.loaded(name)
    if path == "dense":
        h = make_engine(loaded=loaded, paged_states=False, paged_windows=False, prefill_step_size=STEP)
        assert isinstance(h.core.store, DenseStore) and isinstance(h.core.prefix_cache, DensePrefixCache)
    else:
        h = make_engine(loaded=loaded, prefill_step_size=STEP)
        assert isinstance(h.core.store, KVStore) and h.core.store.geometry.states
    return h


@pytest.mark.parametrize(("name", "path"), CASES)
def test_a_shared_long_prefix_resumes_from_a_checkpoint_alone_and_batched(
    name: str, path: str, make_engine: Callable[..., Harness]
) -> None:
    loaded = tiny_archs.loaded(name)
    h = _engine(make_engine, name, path)
    first = _tokens(1, 300)
    assert _run(h, [EngineRequest("first", first, 6, GREEDY)]) == len(first) - 1
    assert h.out.cached["first"] == 0
    if path == "dense":  # checkpoints at 64, 128, 192, 256; the prompt's end (299 tokens); prompt and answer
        assert h.core.prefix_cache.stats().entries == 6

    # 230 tokens in common: the checkpoint at 192 is the longest snapshot of a prefix
    second = first[:230] + _tokens(2, 90)
    prefilled = _run(h, [EngineRequest("second", second, 8, GREEDY)])
    assert h.out.cached["second"] == 192
    assert prefilled == len(second) - 1 - 192
    assert h.out.tokens["second"] == _reference(loaded.model, second, 8)

    # beside two other prompts, one of which shares the head too
    third = first[:150] + _tokens(3, 40)
    other = _tokens(4, 70)
    batch = [EngineRequest("second-again", second, 8, GREEDY), EngineRequest("third", third, 7, GREEDY),
             EngineRequest("other", other, 9, GREEDY)]
    prefilled = _run(h, batch)
    assert h.out.cached["second-again"] == len(second) - 1  # its prompt's end
    assert h.out.cached["third"] == 128
    assert h.out.cached["other"] == 0
    assert prefilled == 0 + (len(third) - 1 - 128) + (len(other) - 1)
    assert h.core.batch.max_batch_seen >= 2
    assert h.out.tokens["second-again"] == h.out.tokens["second"]
    assert h.out.tokens["third"] == _reference(loaded.model, third, 7)
    assert h.out.tokens["other"] == _reference(loaded.model, other, 9)

    # the first prompt again: its prompt's end, after the hits above
    assert _run(h, [EngineRequest("first-again", first, 6, GREEDY)]) == 0
    assert h.out.cached["first-again"] == len(first) - 1
    assert h.out.tokens["first-again"] == h.out.tokens["first"] == _reference(loaded.model, first, 6)

    stats = h.core.prefix_cache.stats()
    assert stats.hits == 4 and stats.misses == 2
    assert stats.hit_tokens == 192 + (len(second) - 1) + 128 + (len(first) - 1)
    assert h.core.store.requests == {}


@pytest.mark.parametrize(("name", "path"), CASES)
def test_an_agent_conversation_resumes_from_the_whole_previous_turn(
    name: str, path: str, make_engine: Callable[..., Harness]
) -> None:
    """Each turn sends the previous prompt, the model's answer and new text: the snapshot
    taken when the previous turn ended holds all of it, so only the new text is prefilled."""
    loaded = tiny_archs.loaded(name)
    h = _engine(make_engine, name, path)
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


def test_checkpoints_are_kept_at_powers_of_two_and_the_last_two_boundaries() -> None:
    cache = DensePrefixCache(block_size=16, checkpoint_tokens=STEP)
    prompt_len = 12 * STEP + 10  # boundaries k = 1 .. 12 before its last token
    kept = [k for k in range(1, 14) if cache.keeps_checkpoint(k * STEP, prompt_len)]
    assert kept == [1, 2, 4, 8, 11, 12]
    assert not cache.keeps_checkpoint(STEP + 1, prompt_len)  # not a boundary
    assert [k for k in range(1, 6) if cache.keeps_checkpoint(k * STEP, 5 * STEP + 1)] == [1, 2, 3, 4]


def test_a_long_prompts_snapshots_hold_a_few_times_its_kv_not_its_square(
    make_engine: Callable[..., Harness]
) -> None:
    """A prompt of 12 boundaries keeps 6 checkpoints (1, 2, 4, 8, 11, 12 boundaries), its
    end and its end with the answer; a prompt parting from it inside boundary 10 resumes
    from boundary 8, token-identical to mlx-lm."""
    loaded = tiny_archs.loaded("gemma3_text")
    h = make_engine(loaded=loaded, paged_states=False, paged_windows=False, prefill_step_size=STEP)
    first = _tokens(5, 12 * STEP + 10)
    _run(h, [EngineRequest("first", first, 4, GREEDY)])
    cache = h.core.prefix_cache
    assert isinstance(cache, DensePrefixCache)
    lengths = sorted(e.snapshot.tokens for e in cache._lru.values())
    assert lengths == [STEP, 2 * STEP, 4 * STEP, 8 * STEP, 11 * STEP, 12 * STEP, len(first) - 1,
                       len(first) + 4]
    second = first[: 10 * STEP + 5] + _tokens(6, 20)
    prefilled = _run(h, [EngineRequest("second", second, 4, GREEDY)])
    assert h.out.cached["second"] == 8 * STEP and prefilled == len(second) - 1 - 8 * STEP
    assert h.out.tokens["second"] == _reference(loaded.model, second, 4)


def test_no_snapshot_is_kept_when_the_prefix_cache_is_off(make_engine: Callable[..., Harness]) -> None:
    loaded = tiny_archs.loaded("qwen3_next")
    h = make_engine(loaded=loaded, paged_states=False, prefill_step_size=STEP, prefix_cache_bytes=0)
    prompt = _tokens(1, 200)
    _run(h, [EngineRequest("a", prompt, 4, GREEDY)])
    assert _run(h, [EngineRequest("b", prompt, 4, GREEDY)]) == len(prompt) - 1
    assert h.core.prefix_cache.stats().entries == 0 and h.core.prefix_cache.nbytes == 0


def _guard(ceiling: int) -> MemoryGuard:
    return MemoryGuard(AllocatorProbe(), enabled=True, tier=Tier.CUSTOM, custom_ceiling_bytes=ceiling)


def test_admission_evicts_snapshots_before_a_request_waits(make_engine: Callable[..., Harness]) -> None:
    """Snapshots fill the room under the ceiling; a long request that fits on an idle server
    is admitted by evicting them (least recently used first), not made to wait or refused."""
    loaded = tiny_archs.loaded("qwen3_next")
    gc.collect()
    mx.clear_cache()
    guard = _guard(1 << 40)
    h = make_engine(guard, loaded=loaded, paged_states=False, prefill_step_size=STEP, wait_timeout_s=60)
    _run(h, [EngineRequest("probe", _tokens(999, 100), 4, GREEDY)])
    h.core.prefix_cache.clear()
    gc.collect()
    mx.clear_cache()
    base = guard.snapshot().footprint_bytes
    for i in range(8):
        _run(h, [EngineRequest(f"p{i}", _tokens(i, 400), 4, GREEDY)])
    cache = h.core.prefix_cache
    held = cache.nbytes
    assert held > 0 and cache.stats().evictions == 0
    long = _tokens(77, 600)
    need = h.core.store.reservation_bytes(len(long) + 4) + h.core.admission.headroom_bytes(STEP)
    guard.configure(ceiling_bytes=base + need + held // 2)
    prefilled = _run(h, [EngineRequest("long", long, 4, GREEDY)])
    assert prefilled == len(long) - 1
    stats = cache.stats()
    assert stats.evictions_by_cause["admission"] + stats.evictions_by_cause["ceiling"] > 0
    assert cache.nbytes < held
    assert not [d for d in guard.recent_decisions() if d.outcome.value in ("wait", "reject")]
    assert h.out.tokens["long"] == _reference(loaded.model, long, 4)
    # the most recent prompt's snapshots were the last to go
    assert cache.lookup((*_tokens(7, 400), 1), count=False) is not None
    assert cache.lookup((*_tokens(0, 400), 1), count=False) is None
