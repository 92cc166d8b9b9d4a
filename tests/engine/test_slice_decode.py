"""A lone decoding row on consecutive blocks is attended as one slice of the pool
(`engine.kv.attention.run_decode`, `DecodeTables(runs=True)`): the same tokens and logprobs as
the paged path, never traced; the allocator gives a request one run of blocks wherever one
is free (first fit), so that the next lone request is read as a slice even after a busy
batch; and where steps are replayed, the engine times both paths and keeps the faster.

Real engine on the tiny float32 model, greedy; the store's own planning, no mocks.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from engine import EngineRequest, SamplingParams
from engine.kv import KVGeometry, KVStore, decode_caches, plan_decode
from engine.kv.attention import decode_attention
from engine.kv.blocks import BlockAllocator
from engine.kv.cache import DecodeTables
from engine.slice_choice import SliceChoice

GEO = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype=mx.float32)


def _request(rid: str, n_prompt: int, max_tokens: int, seed: int) -> EngineRequest:
    rng = random.Random(seed)
    return EngineRequest(rid, tuple(rng.randrange(0, 256) for _ in range(n_prompt)), max_tokens,
                         SamplingParams(temperature=0.0, logprobs=True))


def _alone(make_engine, **config: object):
    h = make_engine(prefill_step_size=64, prefix_cache_bytes=0, **config)
    req = _request("alone", 150, 40, 7)
    h.submit(req)
    h.run_until(lambda: len(h.core.batch.seqs) == 1)
    alloc = h.core.store.get("alone")
    plan = plan_decode(h.core.store, [alloc], h.core.batch.tables)
    h.run_until(lambda: "alone" in h.out.finished)
    return h, plan.groups[0].run_start, alloc.table


def test_a_lone_row_read_as_one_slice_gives_the_paged_paths_tokens_and_logprobs(make_engine):
    sliced, start, table = _alone(make_engine, slice_decode=True)
    paged, paged_start, _ = _alone(make_engine, slice_decode=False)
    assert table == list(range(table[0], table[0] + len(table)))
    assert start == table[0] * 16  # planned as one slice of the pool
    assert paged_start is None
    assert sliced.out.tokens["alone"] == paged.out.tokens["alone"]
    assert len(sliced.out.tokens["alone"]) == 40
    assert sliced.out.logprobs["alone"] == pytest.approx(paged.out.logprobs["alone"], abs=1e-4)


def test_a_lone_sliced_row_is_never_traced_and_a_batch_still_is(make_engine):
    """Its view's length is in the graph's shapes: a traced graph would be rebuilt every step."""
    h = make_engine(prefill_step_size=64, prefix_cache_bytes=0, compile_decode=True, compile_after=1,
                    slice_decode=True)
    h.submit(_request("a", 20, 60, 1))
    h.run_until(lambda: len(h.core.batch.seqs) == 1)
    for _ in range(6):
        h.step()
    assert h.core.stats.decode_traces == 0
    h.submit(_request("b", 20, 60, 2))
    h.run_until(lambda: len(h.core.batch.seqs) == 2)
    h.run_until(lambda: h.core.stats.compiled_steps >= 2)
    assert h.core.stats.decode_traces >= 1


def test_the_slice_is_on_where_steps_are_eager_and_timed_where_they_are_replayed(make_engine):
    """On two H200 machines the eager slice beat the replayed paged step at C=1 on one and
    lost on the other (docs/throughput.md): where steps are replayed, the engine
    times both."""
    eager = make_engine(compile_decode=False).core.batch
    assert (eager.tables.runs, eager.slice_choice) == (True, None)
    replayed = make_engine(compile_decode=True).core.batch
    assert replayed.slice_choice is not None and replayed.slice_choice.chosen is None
    forced = make_engine(compile_decode=True, slice_decode=True).core.batch
    assert (forced.tables.runs, forced.slice_choice) == (True, None)
    off = make_engine(compile_decode=True, slice_decode=False).core.batch
    assert (off.tables.runs, off.slice_choice) == (False, None)


def test_a_lone_row_times_both_paths_then_keeps_one_with_the_same_tokens(make_engine):
    timed = make_engine(prefill_step_size=64, prefix_cache_bytes=0, compile_decode=True, compile_after=1)
    timed.core.batch.slice_choice = choice = SliceChoice(trial_steps=4, trial_turn=2)  # S G G S
    paged = make_engine(prefill_step_size=64, prefix_cache_bytes=0, compile_decode=True, compile_after=1,
                        slice_decode=False)
    for h in (timed, paged):
        h.submit(_request("alone", 30, 40, 3))
        h.run_until(lambda h=h: "alone" in h.out.finished)
    assert choice.chosen is not None
    assert [len(choice.samples[k]) for k in (True, False)] == [4, 4]
    assert all(t > 0 for k in (True, False) for t in choice.samples[k])
    runner = timed.core.batch
    assert runner.sliced_steps >= 3  # the slice's trial: each sample is one step's start to the next's
    assert runner.compiled is not None and runner.compiled.replays >= 3
    report = timed.core.stats.slice_choice
    assert report is not None and report["chosen"] in ("slice", "paged")
    assert timed.out.tokens["alone"] == paged.out.tokens["alone"]
    assert timed.out.logprobs["alone"] == pytest.approx(paged.out.logprobs["alone"], abs=1e-4)


def test_the_chosen_path_stays_watched_and_a_slow_window_times_both_again(make_engine):
    """After the choice the engine keeps timing the kept path's steps; a window slower than
    the other path's trial starts a new trial of both. A negative margin makes every window
    count as slow, so that the wiring shows on a CPU whose two paths cost about the same."""
    timed = make_engine(prefill_step_size=64, prefix_cache_bytes=0, compile_decode=True, compile_after=1)
    timed.core.batch.slice_choice = choice = SliceChoice(trial_steps=3, watch_steps=4, retry_margin=-1.0)
    paged = make_engine(prefill_step_size=64, prefix_cache_bytes=0, compile_decode=True, compile_after=1,
                        slice_decode=False)
    for h in (timed, paged):
        h.submit(_request("alone", 30, 60, 3))
        h.run_until(lambda h=h: "alone" in h.out.finished)
    assert choice.retrials >= 2  # chosen, watched for a window, timed again, chosen again
    assert choice.last_retrial is not None and choice.last_retrial["window_ms"] > 0
    assert timed.core.stats.slice_choice["retrials"] == choice.retrials
    assert timed.out.tokens["alone"] == paged.out.tokens["alone"]  # switching paths changes nothing
    assert timed.out.logprobs["alone"] == pytest.approx(paged.out.logprobs["alone"], abs=1e-4)


def test_a_chosen_path_within_the_margin_is_kept(make_engine):
    h = make_engine(prefill_step_size=64, prefix_cache_bytes=0, compile_decode=True, compile_after=1)
    h.core.batch.slice_choice = choice = SliceChoice(trial_steps=3, watch_steps=4, retry_margin=100.0)
    h.submit(_request("alone", 30, 60, 3))
    h.run_until(lambda: "alone" in h.out.finished)
    assert choice.chosen is not None and choice.retrials == 0


def test_released_blocks_come_back_in_their_order():
    """A released run is handed back as a run (a free stack would give it back
    reversed, and the next lone request would never be one slice)."""
    blocks = BlockAllocator(16)
    first = blocks.allocate(5)
    assert first == [0, 1, 2, 3, 4]
    blocks.release(first)
    assert blocks.allocate(5) == [0, 1, 2, 3, 4]
    assert blocks.allocate(3) == [5, 6, 7]


def test_a_request_after_interleaved_leaves_gets_one_run_of_blocks():
    """The free list used to hand blocks out in release order: after rows left in turn, the
    next request took pieces of several earlier runs, and was never one slice."""
    blocks = BlockAllocator(32)
    _, b, _, d = (blocks.allocate(3) for _ in range(4))  # 0..11
    blocks.release(b)
    blocks.release(d)
    assert blocks.allocate(6) == list(range(9, 15))  # 9..11 and past them, not 9..11 + 3..5
    assert blocks.allocate(3) == [3, 4, 5]  # the lowest run that fits
    assert blocks.free == 32 - 15


def test_without_a_free_run_the_lowest_free_blocks_are_taken():
    blocks = BlockAllocator(8)
    held = blocks.allocate(8)
    blocks.release([held[1], held[4], held[6]])
    assert blocks.allocate(3) == [1, 4, 6]
    assert blocks.allocate(1) is None


def test_blocks_extending_a_prefix_follow_it_when_they_are_free():
    blocks = BlockAllocator(32)
    first = blocks.allocate(10)  # 0..9
    blocks.release(first[4:])  # a prefix cache keeps 0..3
    blocks.allocate(2)  # a bystander takes the lowest run: 4, 5
    assert blocks.allocate(3, after=3) == [6, 7, 8]  # 4 is taken: the lowest run instead
    assert blocks.allocate(2, after=8) == [9, 10]


def test_a_lone_request_after_a_busy_batch_is_read_as_one_slice(make_engine):
    """In a server that had served concurrent requests (the benchmark's warm-up at C=64, on the
    H200), the next lone request sat on pieces of several runs and took the paged path. The
    prefix cache keeps the segment (and the busy prompts' blocks) alive meanwhile."""
    h = make_engine(prefill_step_size=64, slice_decode=True)
    for i, new in enumerate((9, 3, 14, 6, 11)):  # leave in the order 1, 3, 0, 4, 2
        h.submit(_request(f"busy{i}", 40 + 7 * i, new, 10 + i))
    h.run_until(lambda: len(h.out.finished) == 5)
    assert h.core.store.segments  # still held by the prefix cache: blocks are reused, not fresh
    req = _request("alone", 150, 5, 7)
    h.submit(req)
    h.run_until(lambda: len(h.core.batch.seqs) == 1)
    alloc = h.core.store.get("alone")
    assert alloc.table == list(range(alloc.table[0], alloc.table[0] + len(alloc.table)))
    assert plan_decode(h.core.store, [alloc], h.core.batch.tables).groups[0].run_start == alloc.table[0] * 16


def test_only_a_lone_row_on_consecutive_blocks_is_planned_as_a_slice():
    s = KVStore(GEO, block_size=16, segment_tokens=1024)  # 64 blocks
    run = s.reserve("run", 100)  # blocks 0..6
    gap = s.reserve("gap", 20)  # blocks 7..8
    s.reserve("rest", 52 * 16)  # blocks 9..60
    s.release("run")
    split = s.reserve("split", 130)  # 9 blocks, and no free run of 9: 0..6, then 61, 62
    assert split.table == [0, 1, 2, 3, 4, 5, 6, 61, 62]
    for a in (gap, split):
        s.advance(a.request_id, 10)
    tables = DecodeTables(runs=True)
    assert tables.plan(s, [gap]).groups[0].run_start == 7 * 16
    assert DecodeTables(runs=True).plan(s, [split]).groups[0].run_start is None
    assert tables.plan(s, [gap, split]).groups[0].run_start is None  # two rows: the paged path
    assert DecodeTables().plan(s, [gap]).groups[0].run_start is None  # off unless asked for
    assert run.table == [0, 1, 2, 3, 4, 5, 6]


def test_the_slice_attends_what_the_paged_path_attends():
    s = KVStore(GEO, block_size=16, segment_tokens=1024)
    s.reserve("before", 40)
    alloc = s.reserve("row", 200)
    seg = alloc.segment
    for layer in range(GEO.num_layers):  # fill the whole pool: stray reads would show
        seg.keys[layer] = mx.random.normal(seg.keys[layer].shape)
        seg.values[layer] = mx.random.normal(seg.values[layer].shape)
    s.advance("row", 77)
    q = mx.random.normal((1, 8, 1, 32))
    outs = []
    for runs in (True, False):
        plan = DecodeTables(runs=runs).plan(s, [alloc])
        assert (plan.groups[0].run_start is not None) is runs
        (cache, _) = decode_caches(plan, GEO.num_layers)
        outs.append(decode_attention(q, cache, 0.17))
    assert mx.abs(outs[0] - outs[1]).max().item() < 1e-5
