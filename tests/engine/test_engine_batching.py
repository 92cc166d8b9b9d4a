"""Batched, chunked prefill mixed with decode: what a request gets does not depend on
who it shares steps with, and a row's logits processor sees each of its tokens once,
before its next sample.

Real engine on the tiny float32 model, greedy. Prompts are chunked (small step budget)
so several prompts' chunks share prefill calls while other rows decode; rows join and
leave throughout.
"""

from __future__ import annotations

import gc
import itertools
import math
import random

import mlx.core as mx
import numpy as np
import pytest

from engine import EngineRequest, SamplingParams
from engine.logits_processor import LogitsProcessor
from memory import MemoryGuard, estimate_prefill
from memory.ceiling import Tier
from memory.probes.allocator import AllocatorProbe
from memory.tracker import DEFAULT_MARGIN

SHAPES = [(13, 9), (300, 17), (45, 5), (128, 24), (7, 12), (260, 3), (90, 20), (33, 15)]


class Recording:
    """A constraint that allows every token and records the order of events: how many
    tokens had been accepted at each mask request (one per sample)."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.accepted_at_fill: list[int] = []

    def fill_bitmask(self, out: np.ndarray) -> None:
        self.accepted_at_fill.append(len(self.accepted))
        out[:] = -1

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def _request(
    i: int, n_prompt: int, max_tokens: int, processed: bool
) -> tuple[EngineRequest, Recording | None]:
    rng = random.Random(500 + i)
    tokens = tuple(rng.randrange(0, 256) for _ in range(n_prompt))
    recording = Recording() if processed else None
    params = SamplingParams(
        temperature=0.0, logprobs=True,
        processor=LogitsProcessor(constraint=recording, frequency_penalty=0.7) if processed else None,
        logit_bias=((65, 1.5),) if processed else (),
    )
    return EngineRequest(f"p{i}", tokens, max_tokens, params), recording


def _requests() -> list[tuple[EngineRequest, Recording | None]]:
    return [_request(i, n, m, processed=i % 2 == 1) for i, (n, m) in enumerate(SHAPES)]


def test_a_request_gets_the_same_tokens_alone_as_in_a_mixed_batch_of_8(make_engine):
    alone: dict[str, tuple[list[int], list[float]]] = {}
    for req, _ in _requests():
        h = make_engine(prefill_step_size=64, prefix_cache_bytes=0)
        h.submit(req)
        h.run_until(lambda r=req, h=h: r.request_id in h.out.finished)
        alone[req.request_id] = (h.out.tokens[req.request_id], h.out.logprobs[req.request_id])

    pairs = _requests()  # fresh processors
    h = make_engine(prefill_step_size=64, max_step_tokens=160, max_concurrency=16,
                    prefix_cache_bytes=0, prefill_batch=8)
    for req, _ in pairs[:5]:
        h.submit(req)
    h.run_until(lambda: len(h.core.batch.seqs) >= 3)
    for req, _ in pairs[5:]:  # join while others prefill and decode (and some leave)
        h.step()
        h.submit(req)
    h.run_until(lambda: h.out.finished.keys() >= {r.request_id for r, _ in pairs})

    stats = h.core.stats
    assert stats.max_batch >= 5
    assert stats.prefill_calls < stats.prefill_chunks  # prompts shared prefill calls
    for req, recording in pairs:
        tokens, logprobs = alone[req.request_id]
        assert h.out.tokens[req.request_id] == tokens, req.request_id
        assert h.out.logprobs[req.request_id] == pytest.approx(logprobs, abs=1e-4), req.request_id
        assert len(tokens) == req.max_tokens
        if recording is not None:
            # the i-th sample came after exactly i accepted tokens, which are the emitted ones
            assert recording.accepted_at_fill == list(range(len(recording.accepted_at_fill)))
            assert len(recording.accepted_at_fill) >= len(tokens)
            assert recording.accepted == tokens[: len(recording.accepted)]
            assert len(recording.accepted) >= len(tokens) - 1


def test_admission_asks_for_the_steps_whole_batch_of_chunks(make_engine):
    """Two prompts prefill. Under a roomy ceiling their chunks share one call per step;
    under a ceiling with room for one chunk's transient but not the two-row batch's, every
    call runs one chunk alone (the other prompt is asked again later, recorded as nothing),
    and both complete."""
    gc.collect()
    mx.clear_cache()
    guard = MemoryGuard(AllocatorProbe(), enabled=True, tier=Tier.CUSTOM, custom_ceiling_bytes=1 << 40)
    h = make_engine(guard, prefill_step_size=64, max_step_tokens=256, prefix_cache_bytes=0,
                    wait_timeout_s=120)
    for i in range(2):
        h.submit(EngineRequest(f"b{i}", tuple(random.Random(i).randrange(0, 256) for _ in range(900)), 4,
                               SamplingParams(temperature=0.0)))
    h.step()
    assert h.core.stats.prefill_chunks == 2 * h.core.stats.prefill_calls > 0  # both, each call
    admission = h.core.admission
    a, b = h.core.prefilling
    one = admission.chunk_prediction(a, 64)
    two = admission.batch_prediction([(a, 64), (b, 64)])
    assert two >= 2 * one > one
    mx.clear_cache()
    guard.configure(ceiling_bytes=guard.snapshot().footprint_bytes + (one + two) // 2)
    decisions = len(guard.recent_decisions())
    chunks, calls = h.core.stats.prefill_chunks, h.core.stats.prefill_calls
    h.step()
    ran = h.core.stats.prefill_chunks - chunks
    assert ran >= 1
    assert h.core.stats.prefill_calls - calls == ran  # each call ran one chunk: two never fit
    assert all(d.outcome.value != "wait" for d in guard.recent_decisions()[decisions:])
    guard.configure(ceiling_bytes=1 << 40)
    h.run_until(lambda: len(h.out.finished) == 2)
    assert h.out.finished == {"b0": "length", "b1": "length"}


def test_a_batch_of_rows_of_different_shapes_is_predicted_with_its_mask(make_engine):
    """Chunks that differ in start or length run under an array mask of their own; the
    batch's prediction is the estimate with that mask counted (`masked=True`), times the
    tracker's margin. With the tracker forgotten, nothing else raises it (the two chunks'
    own predictions summed are less)."""
    h = make_engine(prefill_step_size=64, max_step_tokens=256, prefix_cache_bytes=0)
    for i in range(2):
        h.submit(EngineRequest(f"s{i}", tuple(random.Random(i).randrange(0, 256) for _ in range(900)), 4,
                               SamplingParams(temperature=0.0)))
    h.step()
    admission = h.core.admission
    a, b = h.core.prefilling
    admission.tracker.reset()
    masked = estimate_prefill(admission.geometry, chunk_tokens=64, context_tokens=a.processed,
                              batch=2, backend=admission.backend, masked=True)
    assert a.processed == b.processed  # same start: only the lengths differ below
    assert admission.batch_prediction([(a, 64), (b, 40)]) == math.ceil(masked.total_bytes * DEFAULT_MARGIN)


def test_ragged_batches_take_no_more_than_was_predicted_for_them(make_engine):
    """Prompts of four lengths prefill in shared calls whose rows differ in start and
    length (array masks). Every call's measured peak stays under the prediction the guard
    was asked about: an invariant that once failed on CUDA, here on the CPU's
    attention (which has no fused path: its estimate counts the scores)."""
    gc.collect()
    mx.clear_cache()
    h = make_engine(prefill_step_size=64, max_step_tokens=256, prefix_cache_bytes=0)
    for i, n in enumerate((300, 170, 90, 45)):
        h.submit(EngineRequest(f"g{i}", tuple(random.Random(i).randrange(0, 256) for _ in range(n)), 2,
                               SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.out.finished) == 4)
    stats = h.core.stats
    assert stats.prefill_calls < stats.prefill_chunks  # some calls ran several prompts' chunks
    chunks = h.core.admission.recent_chunks()
    assert chunks and all(0 < c.measured_bytes <= c.predicted_bytes for c in chunks), chunks


def test_only_a_steps_first_chunk_is_cut_short_by_the_budget(make_engine):
    """Three 100-token prompts under a 250-token step budget: the first two run whole in
    one call, and the third waits for the next step rather than run a remnant beside them
    (a call pads its rows to the longest chunk, and a remnant's next chunk would start
    where its peers' do not)."""
    h = make_engine(prefill_step_size=128, max_step_tokens=250, prefix_cache_bytes=0,
                    max_concurrency=8)
    prompts = [tuple(random.Random(40 + i).randrange(0, 256) for _ in range(100)) for i in range(3)]
    for i, tokens in enumerate(prompts):
        h.submit(EngineRequest(f"c{i}", tokens, 4, SamplingParams(temperature=0.0)))
    h.step()
    assert h.core.stats.prefill_calls == 1
    assert h.core.stats.prefill_chunks == 2
    assert [s.request_id for s in h.core.batch.seqs] == ["c0", "c1"]
    (waiting,) = h.core.prefilling
    assert waiting.request_id == "c2" and waiting.processed == 0
    h.step()  # alone at the head of the next step, it runs whole
    assert waiting.processed == 99
    h.run_until(lambda: len(h.out.finished) == 3)
    assert set(h.out.finished.values()) == {"length"}


def test_a_long_prompt_alone_still_takes_a_cut_chunk_each_step(make_engine):
    """Progress: the step's first chunk may be cut by the budget, so a prompt longer than
    the budget (less the decoding rows) still moves every step."""
    h = make_engine(prefill_step_size=256, max_step_tokens=200, prefix_cache_bytes=0)
    h.submit(EngineRequest("short", (1, 2, 3), 50, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.core.batch.seqs) == 1)
    h.submit(EngineRequest("long", tuple(random.Random(7).randrange(0, 256) for _ in range(700)), 2,
                           SamplingParams(temperature=0.0)))
    seen = []
    while not h.core.batch.seqs or h.core.batch.seqs[-1].request_id != "long":
        h.step()
        seen.extend(s.processed for s in h.core.prefilling)
    assert seen and all(b > a for a, b in itertools.pairwise(seen))  # moved every step
    assert max(b - a for a, b in itertools.pairwise([0, *seen])) <= 199  # budget less one row
