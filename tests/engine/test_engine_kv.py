"""The engine decodes through the KV store: joins, leaves and growth copy no batch KV,
reservations are each request's own length, and outputs match running alone."""

from __future__ import annotations

import gc
import random

import mlx.core as mx
import pytest

from engine import EngineRequest, SamplingParams
from memory import MemoryGuard
from memory.ceiling import Tier
from memory.probes.allocator import AllocatorProbe

GREEDY = SamplingParams(temperature=0.0, logprobs=True)


def prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(0, 256) for _ in range(n))


def request(rid: str, n_prompt: int, max_tokens: int, seed: int | None = None) -> EngineRequest:
    return EngineRequest(rid, prompt(seed if seed is not None else hash(rid) & 0xFFFF, n_prompt),
                         max_tokens, GREEDY)


def running(h) -> set[str]:
    return {s.request_id for s in h.core.batch.seqs}


def test_a_join_and_a_leave_allocate_nothing_the_size_of_the_batch_kv(make_engine, tiny_loaded):
    gc.collect()
    weights = mx.get_active_memory()  # the model's weights (and nothing of this engine yet)
    assert weights >= tiny_loaded.weight_bytes
    h = make_engine(prefill_step_size=1024, max_concurrency=16, prefix_cache_bytes=0)
    for i in range(8):
        h.submit(request(f"r{i}", 900, 64, seed=i))
    h.run_until(lambda: len(running(h)) == 8 and all(len(h.out.tokens.get(f"r{i}", [])) >= 2
                                                     for i in range(8)))
    batch_kv = h.core.stats.kv_bytes
    layer_kv = batch_kv // tiny_loaded.geometry.num_layers
    assert batch_kv >= 8 * 900 * tiny_loaded.geometry.kv_bytes_per_token
    h.submit(request("r8", 24, 64, seed=8))  # a 9th joins ...
    h.abort("r0")  # ... and one leaves
    deltas, peaks = [], []
    for _ in range(12):
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        h.step()
        deltas.append(mx.get_peak_memory() - before)
        peaks.append(mx.get_peak_memory())
    assert "r8" in running(h) and "r0" not in running(h) and len(h.out.tokens["r8"]) >= 2
    # The old left-padded batch concatenated every layer's KV at the join (old and new
    # copies at once): a step's peak rose by more than the whole batch's KV. Now a step
    # holds one layer's gathered K/V and the attention's transients (plain CPU path).
    assert max(deltas) < batch_kv // 2, (max(deltas), batch_kv)
    # Weights + what the store holds + one step's activations: the plain path gathers one
    # layer of the batch's K and V at a time (padded to whole blocks), plus logits.
    stats = h.core.stats
    activations = layer_kv * 3 // 2 + (1 << 20)
    assert max(peaks) <= weights + stats.kv_pool_bytes + activations


def test_one_long_prompt_among_short_ones_reserves_its_own_length(make_engine, tiny_loaded):
    h = make_engine(prefill_step_size=2048, max_concurrency=16, prefix_cache_bytes=0)
    reqs = [request("long", 1500, 8, seed=100)] + [
        request(f"s{i}", 20 + 3 * i, 8, seed=200 + i) for i in range(7)
    ]
    for r in reqs:
        h.submit(r)
    per_token = tiny_loaded.geometry.kv_bytes_per_token
    seen_all = False
    for _ in range(50):
        h.step()
        admitted = h.core._admitted()
        own = sum(s.final_len for s in admitted) * per_token
        # the left-padded batch reserved rows x the longest row (committed_bytes, ~7x here)
        assert h.core.stats.kv_reserved_bytes <= 1.15 * own
        seen_all = seen_all or len(admitted) == len(reqs)
        if h.out.finished.keys() >= {r.request_id for r in reqs}:
            break
    assert seen_all
    assert h.core.stats.kv_reserved_bytes == 0 and h.core.stats.kv_bytes_per_token == per_token


def test_batch_with_joins_and_leaves_matches_each_request_alone(make_engine):
    shapes = [(13, 9), (300, 17), (45, 5), (128, 24), (7, 12), (260, 3), (90, 20), (33, 15)]
    reqs = [request(f"q{i}", n, m, seed=300 + i) for i, (n, m) in enumerate(shapes)]
    alone: dict[str, tuple[list[int], list[float]]] = {}
    for r in reqs:
        h = make_engine(prefill_step_size=256, prefix_cache_bytes=0)
        h.submit(r)
        h.run_until(lambda r=r, h=h: r.request_id in h.out.finished)
        alone[r.request_id] = (h.out.tokens[r.request_id], h.out.logprobs[r.request_id])
    h = make_engine(prefill_step_size=256, max_concurrency=16, prefix_cache_bytes=0)
    for r in reqs[:5]:
        h.submit(r)
    h.run_until(lambda: len(running(h)) >= 4)
    for r in reqs[5:]:  # join while others decode (and some leave meanwhile)
        h.step()
        h.submit(r)
    h.run_until(lambda: h.out.finished.keys() >= {r.request_id for r in reqs})
    assert h.core.stats.max_batch >= 5
    # several prompts' chunks shared a model call (batched prefill), mixed with decode steps
    assert h.core.stats.prefill_calls < h.core.stats.prefill_chunks
    for r in reqs:
        tokens, logprobs = alone[r.request_id]
        assert h.out.tokens[r.request_id] == tokens, r.request_id
        assert h.out.logprobs[r.request_id] == pytest.approx(logprobs, abs=1e-4), r.request_id
        assert len(tokens) == r.max_tokens


def test_a_prefix_hit_shares_the_cached_blocks(make_engine):
    h = make_engine(prefill_step_size=512)
    base = prompt(7, 200)
    h.submit(EngineRequest("a", (*base, 1, 2, 3), 40, GREEDY))
    h.run_until(lambda: "a" in running(h))
    store = h.core.store
    pool = store.stats().pool_bytes
    h.submit(EngineRequest("b", (*base, 9, 9), 40, GREEDY))
    h.run_until(lambda: "b" in running(h))
    a, b = store.get("a"), store.get("b")
    shared = 200 // store.block_size
    assert b.table[:shared] == a.table[:shared]  # the same blocks, not copies
    assert all(a.segment.blocks.refs(blk) >= 3 for blk in a.table[:shared])  # a, b, entries
    assert store.stats().pool_bytes == pool
    h.run_until(lambda: {"a", "b"} <= h.out.finished.keys())
    # b's output equals b computed without the cache
    fresh = make_engine(prefill_step_size=512, prefix_cache_bytes=0)
    fresh.submit(EngineRequest("b", (*base, 9, 9), 40, GREEDY))
    fresh.run_until(lambda: "b" in fresh.out.finished)
    assert h.out.tokens["b"] == fresh.out.tokens["b"]
    assert h.out.logprobs["b"] == pytest.approx(fresh.out.logprobs["b"], abs=1e-4)


def test_an_abort_stops_the_request_at_once_and_frees_its_blocks(make_engine):
    h = make_engine(prefill_step_size=512, prefix_cache_bytes=0)
    for i in range(3):
        h.submit(request(f"x{i}", 50, 200, seed=400 + i))
    h.run_until(lambda: all(len(h.out.tokens.get(f"x{i}", [])) >= 5 for i in range(3)))
    store = h.core.store
    reserved = store.reserved_bytes()
    own = store.get("x1").capacity * store.block_bytes
    emitted = len(h.out.tokens["x1"])
    others = {r: len(h.out.tokens[r]) for r in ("x0", "x2")}
    generated = h.core.stats.generated_tokens
    h.abort("x1")
    assert store.reserved_bytes() == reserved - own  # released when the abort is taken
    for _ in range(10):
        h.step()
    assert h.out.finished["x1"] == "abort"
    assert len(h.out.tokens["x1"]) == emitted  # not one token after the abort
    assert all(len(h.out.tokens[r]) == n + 10 for r, n in others.items())
    assert h.core.stats.generated_tokens - generated == 20  # only the two left decode


def test_a_queued_prefill_is_preempted_when_the_head_cannot_go_on(make_engine):
    """Three long prompts prefill, none decodes; the ceiling drops (a new setting) so the
    head's next chunk no longer fits beside the others' KV. Nothing would ever free memory,
    so the youngest prefill is sent back (its blocks released), and every prompt completes."""
    gc.collect()
    mx.clear_cache()
    guard = MemoryGuard(AllocatorProbe(), enabled=True, tier=Tier.CUSTOM, custom_ceiling_bytes=1 << 40)
    h = make_engine(guard, prefill_step_size=64, kv_segment_tokens=16, prefix_cache_bytes=0,
                    wait_timeout_s=120)
    for i in range(3):
        h.submit(request(f"p{i}", 1200, 4, seed=500 + i))
    h.step()
    assert len(h.core.prefilling) == 3 and not h.core.batch.seqs
    store = h.core.store
    one = store.get("p2").capacity * store.block_bytes
    mx.clear_cache()
    usage = guard.snapshot().footprint_bytes
    guard.configure(ceiling_bytes=usage - one + (4 << 20))
    h.run_until(lambda: len(h.out.finished) == 3)
    assert h.core.stats.preemptions > 0
    assert h.out.finished == {"p0": "length", "p1": "length", "p2": "length"}
    assert all(len(h.out.tokens[f"p{i}"]) == 4 for i in range(3))
    assert store.reserved_bytes() == 0


def test_a_prefix_hit_needs_a_whole_block_in_common(make_engine):
    """Prompts that share only a chat template's first tokens (fewer than a block) are not
    served from the cache: such a hit saves nothing, yet costs a copy-on-write of the block
    and starts the prompt's chunks off offset 0."""
    h = make_engine(prefill_step_size=512)
    head = prompt(11, 9)
    h.submit(EngineRequest("a", (*head, *prompt(12, 100)), 4, GREEDY))
    h.run_until(lambda: "a" in h.out.finished)
    bs = h.core.store.block_size
    assert len(head) < bs
    h.submit(EngineRequest("b", (*head, *prompt(13, 100)), 4, GREEDY))
    h.submit(EngineRequest("c", (*head, *prompt(12, 100)[:bs], 7, 7), 4, GREEDY))
    h.run_until(lambda: {"b", "c"} <= h.out.finished.keys())
    assert h.out.cached["b"] == 0
    assert h.out.cached["c"] == len(head) + bs


def test_a_prefix_hit_writes_into_a_segment_nothing_queued_still_reads(make_engine):
    """A hit copies the prefix's partly filled last block into the request's own block, in
    the segment the queued decode step reads. The engine lets that step finish first: were
    it still queued, MLX would copy each of the segment's layer arrays rather than write
    one block in place. The decode step is held lazy here (never queued) so that it is
    certainly unfinished when the request is admitted."""
    h = make_engine(prefill_step_size=512)
    base = prompt(21, 200)
    h.submit(EngineRequest("a", (*base, 1, 2, 3), 60, GREEDY))
    h.run_until(lambda: "a" in running(h) and len(h.out.tokens.get("a", [])) >= 2)
    runner = h.core.batch
    runner._queue = lambda step: None  # the next steps' decode stays unevaluated
    h.step()
    assert runner.pending is not None
    segment = h.core.store.get("a").segment
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    h.submit(EngineRequest("b", (*base, 9, 9), 8, GREEDY))
    h.step()
    assert h.core.store.get("b").length > 200 % h.core.store.block_size  # the hit was taken
    layer_array = segment.keys[0].nbytes
    assert mx.get_peak_memory() - before < layer_array  # nothing the size of a layer array
