"""A decode step's tokens are handed out before the next step's prefill, not after it.

A step's prefill call waits for the queued decode step (it writes the pool that step
reads). The tokens of that decode step used to be read only by the step's own decode,
after the prefill: a request whose prompt had just finished got its first token a whole
prefill chunk late (beside a long prompt, 138 ms a chunk at 80k of context on an H100).
These tests run both store paths (the paged store; mlx-lm's own caches for a windowed
model) and check the order, that nothing changes in what is generated (greedy and seeded
sampling, whose noise follows each row's step count), and the step counters.
"""

from __future__ import annotations

import random

import pytest

from engine import EngineRequest, SamplingParams
from tests.engine import tiny_archs


def _loaded(path: str):
    return tiny_archs.loaded("gemma3_text") if path == "dense" else None  # windows: mlx-lm's caches


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(random.Random(seed).randrange(0, 256) for _ in range(n))


def _watch_first_token(h, request_id: str, other: str) -> list[int]:
    """How many prompt tokens `other` had run when `request_id`'s first token went out."""
    seen: list[int] = []
    publish = h.core.publish

    def watched(outputs):
        if not seen and any(o.request_id == request_id and o.new_tokens for o in outputs):
            seen.append(next(s.processed for s in h.core.prefilling if s.request_id == other))
        publish(outputs)

    h.core.publish = watched
    return seen


@pytest.mark.parametrize("path", ["paged", "dense"])
def test_a_finished_prompt_gets_its_first_token_before_the_next_prefill_call(make_engine, path: str) -> None:
    h = make_engine(loaded=_loaded(path), prefill_step_size=64, max_step_tokens=64, prefix_cache_bytes=0)
    seen = _watch_first_token(h, "short", "long")
    h.submit(EngineRequest("short", _prompt(1, 40), 4, SamplingParams(temperature=0.0)))
    h.core.step()  # the short prompt prefills and joins; its first decode step is queued
    assert h.out.tokens.get("short", []) == []
    h.submit(EngineRequest("long", _prompt(2, 400), 2, SamplingParams(temperature=0.0)))
    h.core.step()  # the long prompt's first chunk: the short's token went out before it ran
    assert seen == [0] and h.core.prefilling[0].processed > 0
    h.run_until(lambda: {"short", "long"} <= set(h.out.finished))
    assert len(h.out.tokens["short"]) == 4 and len(h.out.tokens["long"]) == 2


@pytest.mark.parametrize("path", ["paged", "dense"])
def test_tokens_read_early_are_the_tokens_read_late(make_engine, path: str) -> None:
    """Rows decoding beside a long prompt's prefill (read early every step) generate what
    they generate alone: greedy, and seeded sampling, whose noise is keyed by the row's step."""
    loaded = _loaded(path)
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=1.0, seed=7)]
    got = []
    for beside_a_prefill in (False, True):
        h = make_engine(loaded=loaded, prefill_step_size=32, max_step_tokens=48, prefix_cache_bytes=0)
        for i, sp in enumerate(params):
            h.submit(EngineRequest(f"r{i}", _prompt(10 + i, 30), 12, sp))
        h.core.step()
        if beside_a_prefill:
            h.submit(EngineRequest("long", _prompt(3, 600), 1, SamplingParams(temperature=0.0)))
        h.run_until(lambda h=h: {"r0", "r1"} <= set(h.out.finished))
        if beside_a_prefill:
            assert "long" not in h.out.finished  # its chunks ran beside every decode step
            assert h.core.stats.decode_rows == h.core.stats.generated_tokens  # one row, one token a step
        got.append({r: (h.out.tokens[r], h.out.logprobs[r]) for r in ("r0", "r1")})
    assert got[1]["r0"][0] == got[0]["r0"][0] and got[1]["r1"][0] == got[0]["r1"][0]
    assert got[1]["r0"][1] == pytest.approx(got[0]["r0"][1], abs=1e-5)


def test_speculating_rows_beside_a_prefill_emit_each_token_once(make_engine) -> None:
    """Prompt lookup drafts from a repeating text while a long prompt prefills: a token
    read early is emitted once (not again by the verifying step), drafts are looked up in
    the text as it is (that token once), and output and acceptance are those of the row
    speculating alone."""
    from engine.speculative import SpeculativeConfig

    prompt = _prompt(5, 9) * 5
    lookup = SpeculativeConfig("prompt-lookup", num_tokens=4, max_rows=8)
    got, accepted = [], []
    for spec, beside in ((None, True), (lookup, False), (lookup, True)):
        h = make_engine(prefill_step_size=32, max_step_tokens=48, prefix_cache_bytes=0,
                        **({"speculative": spec} if spec else {}))
        h.submit(EngineRequest("r", prompt, 24, SamplingParams(temperature=0.0)))
        h.core.step()
        if beside:
            h.submit(EngineRequest("long", _prompt(3, 1600), 1, SamplingParams(temperature=0.0)))
        h.run_until(lambda h=h: "r" in h.out.finished)
        assert "long" not in h.out.finished
        got.append(h.out.tokens["r"])
        if spec:
            accepted.append(h.core.batch.speculator.report()["accepted_tokens"])
    assert len(got[0]) == 24 and got[1] == got[0] and got[2] == got[0]
    assert accepted[1] == accepted[0] > 0
