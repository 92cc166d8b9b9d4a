"""Decode steps replayed from traced graphs (`engine.compiled_decode`): the same tokens and
logprobs as eager steps, while rows join, leave and cross block boundaries; and the replayed
step writes the KV pool in place.

Real engine on the tiny float32 model, greedy, with compilation switched on (by default it
is on for CUDA only). The CPU's attention path (`plain_decode`) depends on the context length through
its block count, so a graph key that missed it would replay stale graphs.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from engine import EngineRequest, SamplingParams
from engine.logits_processor import LogitsProcessor

SHAPES = [(13, 60), (300, 45), (45, 70), (128, 30), (7, 52), (90, 64)]


def _requests() -> list[EngineRequest]:
    out = []
    for i, (n_prompt, max_tokens) in enumerate(SHAPES):
        rng = random.Random(900 + i)
        penalised = i % 3 == 2  # a row whose sampler reads back its tokens (the feedback path)
        params = SamplingParams(
            temperature=0.0, logprobs=True,
            processor=LogitsProcessor(frequency_penalty=0.5) if penalised else None,
        )
        out.append(EngineRequest(f"c{i}", tuple(rng.randrange(0, 256) for _ in range(n_prompt)),
                                 max_tokens, params))
    return out


def _started(make_engine, **config: object):
    """An engine whose first three requests decoded together for a while (long enough to
    be traced and replayed), the other three just submitted."""
    h = make_engine(prefill_step_size=64, max_concurrency=8, prefix_cache_bytes=0, **config)
    requests = _requests()
    for req in requests[:3]:
        h.submit(req)
    h.run_until(lambda: len(h.core.batch.seqs) >= 3)
    for _ in range(12):
        h.step()
    for req in requests[3:]:
        h.submit(req)
    return h


def _run(make_engine, **config: object):
    h = _started(make_engine, **config)
    h.run_until(lambda: h.out.finished.keys() >= {r.request_id for r in _requests()})
    return h


def test_replayed_steps_give_the_eager_steps_tokens_and_logprobs(make_engine):
    eager = _run(make_engine, compile_decode=False)
    compiled = _run(make_engine, compile_decode=True, compile_after=2)

    stats = compiled.core.stats
    assert eager.core.stats.compiled_steps == 0
    assert stats.decode_traces >= 2  # several batch sizes held still
    assert stats.compiled_steps >= 3 * stats.decode_traces  # graphs were replayed, not just traced
    assert stats.compiled_steps < stats.decode_steps  # ramps stayed eager
    for req in _requests():
        rid = req.request_id
        assert compiled.out.tokens[rid] == eager.out.tokens[rid], rid
        assert compiled.out.logprobs[rid] == pytest.approx(eager.out.logprobs[rid], abs=1e-4), rid
        assert len(compiled.out.tokens[rid]) == req.max_tokens


def test_a_shape_is_traced_only_after_it_held_for_compile_after_steps(make_engine):
    # a lone row on the paged path: on one slice of the pool it would never be traced
    h = make_engine(prefill_step_size=64, prefix_cache_bytes=0, compile_decode=True, compile_after=5,
                    slice_decode=False)
    h.submit(EngineRequest("a", tuple(range(20)), 40, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.core.batch.seqs) == 1)  # the step it joined in decoded it once
    for _ in range(3):
        h.step()
    assert h.core.stats.decode_steps == 4
    assert h.core.stats.decode_traces == 0
    h.step()
    assert (h.core.stats.decode_traces, h.core.stats.compiled_steps) == (1, 1)


def test_a_replayed_step_writes_the_pool_in_place(make_engine):
    """With one large segment, a step that copied the pool instead of writing in place
    would raise MLX's peak by at least one layer array."""
    h = make_engine(prefill_step_size=64, prefix_cache_bytes=0, compile_decode=True, compile_after=1,
                    kv_segment_tokens=131_072)
    for i in range(4):
        h.submit(EngineRequest(f"w{i}", tuple(range(i, i + 30)), 60, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.core.batch.seqs) == 4)
    h.run_until(lambda: h.core.stats.compiled_steps >= 2)  # traced, and replayed once
    (segment,) = h.core.store.segments.values()
    layer_bytes = segment.keys[0].nbytes
    mx.eval(segment.arrays())
    before = h.core.stats.compiled_steps
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(10):
        h.step()
    peak = mx.get_peak_memory() - base
    assert h.core.stats.compiled_steps == before + 10
    assert layer_bytes >= 30 << 20
    assert peak < layer_bytes / 4, (peak, layer_bytes)


def test_compiled_decode_is_on_by_default_on_cuda_only_and_follows_the_setting(make_engine) -> None:
    default = make_engine()
    assert (default.core.batch.compiled is not None) is (default.core.loaded.backend == "cuda")
    assert make_engine(compile_decode=True).core.batch.compiled is not None
    assert make_engine(compile_decode=False).core.batch.compiled is None


def _lone(make_engine, max_tokens: list[int], **config: object):
    """Requests of one prompt and different `max_tokens`, one after another, each alone."""
    h = make_engine(prefill_step_size=64, prefix_cache_bytes=0, compile_after=2, slice_decode=False,
                    **config)
    traces = []
    for i, n in enumerate(max_tokens):
        params = SamplingParams(temperature=0.0, logprobs=True)
        h.submit(EngineRequest(f"r{i}", tuple(range(3, 23)), n, params))
        h.run_until(lambda i=i: f"r{i}" in h.out.finished)
        traces.append(h.core.stats.decode_traces)
    return h, traces


def test_requests_of_nearby_sizes_replay_one_another_s_graphs(make_engine):
    """A block table as wide as each request's capacity put that width in every graph's
    shapes: a lone request 5 blocks long (20 + 60 tokens) and one 7 blocks long (20 + 92)
    traced a graph each for the same context lengths. Rounded to a power of two, both
    tables are 8 wide, and the second request traces only the block counts the first never
    reached (the CPU's attention gathers by block count, so each count is a graph)."""
    compiled, traces = _lone(make_engine, [60, 92], compile_decode=True)
    eager, _ = _lone(make_engine, [60, 92], compile_decode=False)
    assert traces[0] == 4  # 2, 3, 4 and 5 blocks read
    assert traces[1] - traces[0] == 2  # only the 6- and 7-block reads are new
    for rid in ("r0", "r1"):
        assert compiled.out.tokens[rid] == eager.out.tokens[rid], rid
        assert compiled.out.logprobs[rid] == pytest.approx(eager.out.logprobs[rid], abs=1e-4), rid


def _segments_seen(h) -> int:
    """Steps until every request finished, counting the most segments live at once."""
    most = 0
    for _ in range(10_000):
        if h.out.finished.keys() >= {r.request_id for r in _requests()}:
            return most
        most = max(most, len(h.core.store.segments))
        h.step()
    raise AssertionError("engine did not finish")


def _run_counting(make_engine, **config: object):
    h = _started(make_engine, **config)
    return h, _segments_seen(h)


def _same_tokens(compiled, eager) -> None:
    for req in _requests():
        rid = req.request_id
        assert compiled.out.tokens[rid] == eager.out.tokens[rid], rid
        assert compiled.out.logprobs[rid] == pytest.approx(eager.out.logprobs[rid], abs=1e-4), rid


def test_window_layers_replay_the_eager_steps_tokens(make_engine, window_loaded):
    """Window groups' rings (a window of 64 tokens, rows of up to 370) are arrays of the
    traced step like the full group's tables: the replayed steps give the eager tokens."""
    eager = _run(make_engine, loaded=window_loaded, compile_decode=False)
    compiled = _run(make_engine, loaded=window_loaded, compile_decode=True, compile_after=2)
    assert compiled.core.store.geometry.windowed
    stats = compiled.core.stats
    assert stats.decode_traces >= 2 and stats.compiled_steps >= 3 * stats.decode_traces
    _same_tokens(compiled, eager)


@pytest.mark.parametrize("window", [False, True])
def test_rows_in_several_segments_replay_the_eager_steps_tokens(make_engine, window_loaded, window: bool):
    """Small segments hold one or a few of the requests each: a step's rows live in
    several segments (each its own group, reordered after), and it still replays."""
    loaded = {"loaded": window_loaded} if window else {}
    tokens = 2048 if window else 512  # a window model's request keeps room for ring copies beside it
    eager, _ = _run_counting(make_engine, compile_decode=False, kv_segment_tokens=tokens, **loaded)
    compiled, segments = _run_counting(make_engine, compile_decode=True, compile_after=2,
                                       kv_segment_tokens=tokens, **loaded)
    assert segments >= 2
    stats = compiled.core.stats
    assert stats.decode_traces >= 2 and stats.compiled_steps >= 3 * stats.decode_traces
    assert any(len(key[0]) > 1 for key in compiled.core.batch.compiled.graphs)  # a graph over segments
    _same_tokens(compiled, eager)


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
def test_a_hybrids_state_is_traced_with_its_steps(make_engine, name: str):
    """A hybrid's batch state (engine.kv.state: qwen3_next's delta-net, lfm2's short
    convolutions) goes into the traced step and comes back updated, as the pool's layer
    arrays do: the replayed steps give the eager tokens."""
    from tests.engine import tiny_archs

    loaded = {"loaded": tiny_archs.loaded(name)}
    eager = _run(make_engine, compile_decode=False, **loaded)
    compiled = _run(make_engine, compile_decode=True, compile_after=2, **loaded)
    assert compiled.core.store.geometry.states
    stats = compiled.core.stats
    assert stats.decode_traces >= 2 and stats.compiled_steps >= 3 * stats.decode_traces
    _same_tokens(compiled, eager)
