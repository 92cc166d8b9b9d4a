"""The next prefill chunk's attention shape planned while this chunk runs (engine.kv.plan_ahead).

Where the backend plans each new attention shape (CUDA), a lone prompt's chunks after the
first attend their exact keys, causal, because the chunk before queued one layer's
attention at their shape; the tokens stay those of the engine that pads every call. On the
CPU nothing is planned, so these tests turn the bucket and a plan's cost on, as
tests/engine/test_key_buckets.py does.
"""

from __future__ import annotations

import random

import pytest

from engine import EngineRequest, SamplingParams
from engine.kv.buckets import padded_keys

PROMPT = tuple(random.Random(7).randrange(0, 256) for _ in range(300))


def _run(make_engine, **config) -> tuple[list[int], list[float], object]:
    h = make_engine(prefill_step_size=32, prefix_cache_bytes=0, prefill_key_bucket=4096, **config)
    h.submit(EngineRequest("long", PROMPT, 12, SamplingParams(temperature=0.0, logprobs=True)))
    h.run_until(lambda: "long" in h.out.finished)
    return h.out.tokens["long"], h.out.logprobs["long"], h.core


def test_later_chunks_attend_exact_keys_planned_by_the_chunk_before(make_engine) -> None:
    """Chunks of 32 queries always pad (below EXACT_MIN_QUERIES) unless planned ahead: with a
    plan cheaper than padding, each chunk plans the next, and the planned ones run exact;
    with a plan that no chunk hides, none does."""
    tokens, logprobs, core = _run(make_engine, prefill_plan_ms=1e-6)
    lengths = core.store.key_lengths
    # Chunk k (from 1) plans chunk k + 1 where a full chunk follows and its end is not a
    # length the bucket pads to anyway (256): a plan this cheap pays behind any chunk.
    ends = [32 * (k + 1) for k in range(1, len(PROMPT) // 32) if len(PROMPT) - 32 * k >= 32]
    planned = [end for end in ends if padded_keys(end, 4096) != end]
    assert len(planned) == 7
    assert core.store.key_lengths.planned_ahead == len(planned)
    assert lengths.exact_calls == len(planned)
    padded_tokens, padded_logprobs, padded_core = _run(make_engine, prefill_plan_ms=1e9)
    assert padded_core.store.key_lengths.planned_ahead == 0
    assert padded_core.store.key_lengths.exact_calls == 0
    assert tokens == padded_tokens
    assert logprobs == pytest.approx(padded_logprobs, abs=1e-4)


def test_plan_ahead_off_plans_nothing(make_engine) -> None:
    """`--no-plan-ahead` (an A/B): every chunk pads as before, and the tokens are the same."""
    tokens, _, core = _run(make_engine, prefill_plan_ms=1e-6, plan_ahead=False)
    assert core.store.key_lengths.planned_ahead == 0 == core.store.key_lengths.exact_calls
    assert tokens == _run(make_engine, prefill_plan_ms=1e-6)[0]


def test_nothing_is_planned_where_shapes_cost_no_plan(make_engine) -> None:
    """The CPU and Metal plan nothing per shape (no bucket): no warm-up call is made."""
    h = make_engine(prefill_step_size=32, prefix_cache_bytes=0)
    h.submit(EngineRequest("long", PROMPT, 4, SamplingParams(temperature=0.0)))
    h.run_until(lambda: "long" in h.out.finished)
    assert h.core.store.key_bucket == 0
    assert h.core.store.key_lengths.planned_ahead == 0
