"""Prefill that shares the step with decode (engine.step_budget): the cost line, the step's
time budget, the prefill order, and the engine driven step by step on the tiny model.

Engine tests count steps and tokens, never time: a stall target of a microsecond cuts every
step's prefill to the smallest chunk whatever the machine measures, and a fixed cost line
stands in for the measured one where the test checks how chunks follow it.
"""

from __future__ import annotations

import itertools
import random

import pytest

from engine import EngineRequest, SamplingParams
from engine.sequence import Sequence
from engine.step_budget import Line, PrefillCost, StepBudget, prefill_order

FLOOR = 32  # EngineConfig.min_chunk_tokens
TINY_TARGET_S = 1e-6  # no prefill fits: every step runs the floor


def _request(rid: str, n: int, max_tokens: int = 1) -> EngineRequest:
    rng = random.Random(rid)
    tokens = tuple(rng.randrange(0, 256) for _ in range(n))
    return EngineRequest(rid, tokens, max_tokens, SamplingParams(temperature=0.0))


# ---- the cost line ------------------------------------------------------------------------
def test_the_line_is_fitted_from_calls_at_growing_context() -> None:
    true = Line(per_token_s=2e-4, per_context_s=3e-8)
    cost = PrefillCost()
    for context in range(0, 16384, 512):  # a long prompt's chunks
        cost.observe([(context, 512)], true.seconds(context, 512))
    assert cost.line is not None
    assert cost.line.per_token_s == pytest.approx(true.per_token_s, rel=1e-6)
    assert cost.line.per_context_s == pytest.approx(true.per_context_s, rel=1e-6)


def test_calls_at_one_context_give_a_flat_line() -> None:
    cost = PrefillCost()
    for _ in range(4):
        cost.observe([(0, 100)], 0.01)
    assert cost.line is not None
    assert (cost.line.per_token_s, cost.line.per_context_s) == (pytest.approx(1e-4), 0.0)


@pytest.mark.parametrize(("line", "seconds", "context"), [
    (Line(1e-4, 0.0), 0.05, 0),
    (Line(1e-4, 1e-8), 0.05, 0),
    (Line(1e-4, 1e-8), 0.05, 30_000),
    (Line(0.0, 1e-7), 0.1, 100),
    (Line(3e-5, 2e-9), 0.088, 95_000),
])
def test_tokens_within_is_the_most_that_fits(line: Line, seconds: float, context: int) -> None:
    n = line.tokens_within(seconds, context)
    assert n > 0
    assert line.seconds(context, n) <= seconds < line.seconds(context, n + 1)


def test_no_time_left_fits_nothing() -> None:
    assert Line(1e-4, 1e-8).tokens_within(0.0, 0) == 0
    assert Line(1e-4, 1e-8).tokens_within(-0.01, 0) == 0


def test_a_slow_call_moves_the_line_only_so_far_and_a_lasting_change_all_the_way() -> None:
    cost = PrefillCost()
    for _ in range(40):
        cost.observe([(0, 512)], 512e-4)
    assert cost.line is not None
    cost.observe([(0, 512)], 100 * 512e-4)  # a kernel compiling on first use
    assert cost.line.per_token_s < 1.1e-4
    for _ in range(80):  # the machine got three times slower
        cost.observe([(0, 512)], 3 * 512e-4)
    assert cost.line.per_token_s == pytest.approx(3e-4, rel=0.1)


# ---- the step's budget --------------------------------------------------------------------
def _budget(target_s: float | None, decode_s: float) -> StepBudget:
    budget = StepBudget(target_s, floor_tokens=FLOOR)
    budget.observe_prefill([(0, 1000)], 1000 * 1e-4)  # 0.1 ms a token, at any context
    budget.observe_step(decode_s, 0.0)
    return budget


T = 0.05005  # 50 ms and half a token's time


@pytest.mark.parametrize(("target_s", "decode_s", "decoding", "budget", "first", "then"), [
    (None, 0.01, True, 511, 511, 511),  # no target: the token budget alone
    (T, 0.01, False, 512, 512, 512),  # nothing decodes: full size
    (T, 0.01, True, 511, 400, 0),  # 40 ms left: 400 tokens, then nothing
    (T, 0.03, True, 511, 200, 0),  # a slower decode step leaves less
    (T, 0.01, True, 300, 300, 100),  # the token budget binds first; 10 ms left after it
    (T, 0.06, True, 511, FLOOR, 0),  # the decode step alone is over: the floor, once
    (T, 0.06, True, 20, 20, 0),  # the floor never exceeds the token budget
])
def test_a_steps_prefill_gets_what_the_target_leaves(
    target_s: float | None, decode_s: float, decoding: bool, budget: int, first: int, then: int
) -> None:
    b = _budget(target_s, decode_s)
    b.begin(decoding=decoding)
    assert b.allow(0, budget) == first
    b.spend(0, first)
    assert b.allow(first, budget) == then


def test_the_decode_step_is_what_a_step_took_besides_its_prefill() -> None:
    b = StepBudget(0.1, floor_tokens=FLOOR)
    b.observe_step(0.05, 0.03)
    assert b.decode_s == pytest.approx(0.02)
    b.observe_step(1.0, 0.0)  # one slow step counts as twice the average at most
    assert b.decode_s == pytest.approx(0.02 + 0.2 * (0.04 - 0.02))


# ---- the order ------------------------------------------------------------------------------
def _seq(rid: str, prompt: int, processed: int = 0, passed_over: int = 0) -> Sequence:
    seq = Sequence(_request(rid, prompt), chunk_tokens=64, processed=processed)
    seq.passed_over = passed_over
    return seq


@pytest.mark.parametrize(("seqs", "order"), [
    ([("long", 2001, 0, 0), ("short", 101, 0, 0)], ["short", "long"]),
    ([("a", 101, 0, 0), ("b", 101, 0, 0)], ["a", "b"]),  # ties keep arrival order
    ([("long", 2001, 1000, 0), ("short", 1101, 0, 0)], ["long", "short"]),  # remaining, not length
    ([("long", 2001, 0, 29), ("short", 201, 0, 0)], ["long", "short"]),  # 2000 - 29 x 64 < 200
    ([("long", 2001, 0, 28), ("short", 201, 0, 0)], ["short", "long"]),
])
def test_shortest_remaining_prefill_first_with_aging(
    seqs: list[tuple[str, int, int, int]], order: list[str]
) -> None:
    assert [s.request_id for s in prefill_order([_seq(*s) for s in seqs])] == order


# ---- the engine -----------------------------------------------------------------------------
def _prefill_steps(h, rid: str) -> list[tuple[int, int]]:
    """Step until `rid` joins the batch: per step, (its prompt tokens run, tokens the engine
    emitted to the others)."""
    seq = next(s for s in [*h.core.waiting, *h.core.prefilling] if s.request_id == rid)
    steps = []
    while seq in h.core.waiting or seq in h.core.prefilling:
        processed, emitted = seq.processed, h.core.stats.generated_tokens
        h.step()
        steps.append((seq.processed - processed, h.core.stats.generated_tokens - emitted))
    return steps


def test_a_long_prompt_shares_every_step_with_a_decoding_stream(make_engine):
    """A stream decodes; a 1,000-token prompt arrives. Under a target nothing fits, each
    step runs the smallest chunk of it and one decode step: the stream gets a token between
    every two of its chunks. With no target, the same prompt takes a whole chunk a step.
    Either way both requests get the same tokens."""
    outputs = []
    for target, chunk in ((TINY_TARGET_S, FLOOR), (None, 255)):
        h = make_engine(prefill_step_size=256, max_decode_stall_s=target, prefix_cache_bytes=0)
        h.submit(_request("stream", 20, max_tokens=60))
        h.run_until(lambda h=h: len(h.core.batch) == 1)
        h.submit(_request("long", 1000, max_tokens=8))
        steps = _prefill_steps(h, "long")
        assert all(emitted == 1 for _, emitted in steps)  # one decode step each
        *middle, last = [ran for ran, _ in steps]
        assert middle and all(ran == chunk for ran in middle), steps
        assert 0 < last < chunk + FLOOR  # the prompt is finished rather than left a few
        assert sum(ran for ran, _ in steps) == 999
        report = h.core.stats.step_budget  # /v1/memory's engine.step_budget
        assert report is not None and report["decode_step_ms"] is not None
        assert report["bounded_steps"] == (len(steps) if target else 0)
        h.run_until(lambda h=h: len(h.out.finished) == 2)
        outputs.append(h.out.tokens)
    assert outputs[0] == outputs[1]


def test_a_model_served_through_mlx_lms_caches_shares_the_step_alike(make_engine):
    """The dense path (a sliding-window model) waits for the queued decode step before its
    prefill as the paged one does, so the same rule holds: one floor-sized chunk a step."""
    from engine.cache_layout import geometry_for, probe_cache_layout
    from engine.dense import DenseStore
    from engine.loader import LoadedModel
    from tests.engine import tiny_archs

    model = tiny_archs.build("gemma3_text")
    layout = probe_cache_layout(model, weights_loaded=True)
    loaded = LoadedModel(model=model, tokenizer=None, model_id="gemma3_text", path="",
                         geometry=geometry_for(model, layout), backend="cpu",
                         context_length=4096, weight_bytes=0, layout=layout)
    h = make_engine(loaded=loaded, paged_windows=False, prefill_step_size=256,
                    max_decode_stall_s=TINY_TARGET_S, prefix_cache_bytes=0)
    assert isinstance(h.core.store, DenseStore)
    h.submit(_request("stream", 20, max_tokens=200))
    h.run_until(lambda: len(h.core.batch) == 1)
    h.submit(_request("long", 300))
    steps = _prefill_steps(h, "long")
    assert [ran for ran, _ in steps] == [FLOOR] * 8 + [43] and all(e == 1 for _, e in steps)
    assert h.core.batch.settle_s > 0


def test_a_long_prompt_alone_prefills_at_full_size(make_engine):
    h = make_engine(prefill_step_size=256, max_decode_stall_s=TINY_TARGET_S, prefix_cache_bytes=0)
    h.submit(_request("long", 1000))
    assert [ran for ran, _ in _prefill_steps(h, "long")] == [256, 256, 256, 231]


def test_chunks_follow_the_cost_line_at_their_context(make_engine):
    """A fixed line (0.1 ms a token plus 0.1 µs per token of context) and decode step
    (10 ms) under a 50 ms target: each chunk is what 40 ms buys at its context, so the
    chunks shrink as the prompt grows."""
    h = make_engine(prefill_step_size=512, max_decode_stall_s=0.05, prefix_cache_bytes=0)
    h.submit(_request("stream", 20, max_tokens=500))
    h.run_until(lambda: len(h.core.batch) == 1)
    budget = h.core.step_budget
    line = Line(per_token_s=1e-4, per_context_s=1e-7)
    budget.cost.line = line
    budget.decode_s = 0.01
    budget.observe_prefill = lambda chunks, seconds: None  # type: ignore[method-assign]
    budget.observe_step = lambda step_s, prefill_s: None  # type: ignore[method-assign]
    h.submit(_request("long", 3000))
    steps = [ran for ran, _ in _prefill_steps(h, "long")]
    context = 0
    for ran in steps[:-1]:
        assert ran == min(line.tokens_within(0.05 - 0.01, context), 511)
        context += ran
    assert len(steps) > 5 and all(b < a for a, b in itertools.pairwise(steps[:-1])), steps
    assert sum(steps) == 2999


def test_a_short_prompt_arriving_during_a_long_prefill_finishes_first(make_engine):
    """One chunk a step: first come, first served, the long prompt would hold every step
    until its last chunk. The short one arrives three steps in and is prefilled in the
    next two steps; the long one goes on after it."""
    h = make_engine(prefill_step_size=64, prefix_cache_bytes=0)
    h.submit(_request("long", 1500))
    for _ in range(3):
        h.step()
    h.submit(_request("short", 100))
    joined: list[tuple[str, int]] = []  # (request, steps since the short one arrived)
    steps = 0
    while len(joined) < 2:
        before = {s.request_id for s in h.core.prefilling}
        h.step()
        steps += 1
        joined += [(rid, steps) for rid in before - {s.request_id for s in h.core.prefilling}]
    assert joined[0] == ("short", 2)  # 99 tokens: 64, then 35
    assert joined[1][0] == "long"


def test_a_long_prompt_is_not_starved_by_short_prompts_arriving_every_step(make_engine):
    """A new 60-token prompt every step, each of which alone would take the step's one
    chunk: the long prompt gives way until it has waited as many steps as it takes alone
    (aging), then goes first, and finishes within about twice those steps."""
    h = make_engine(prefill_step_size=64, prefix_cache_bytes=0, max_concurrency=64)
    h.submit(_request("long", 1281))  # 20 chunks alone
    (long,) = h.core.waiting
    steps = 0
    while long in h.core.waiting or long in h.core.prefilling:
        h.submit(_request(f"short{steps}", 60))
        h.step()
        steps += 1
        assert steps <= 42
    assert long.processed == 1280
    h.run_until(lambda: len(h.out.finished) == steps + 1)
