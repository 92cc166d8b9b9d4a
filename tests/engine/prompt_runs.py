"""Helpers shared by the prefix tests on tiny architectures (not a conftest: these are plain
functions): random prompts, mlx-lm's own greedy answer, and running requests to their end
while counting what the engine prefilled."""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine import EngineRequest
from tests.engine import tiny_archs
from tests.engine.conftest import Harness


def random_tokens(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(tiny_archs.VOCAB) for _ in range(n))


def reference(model: object, prompt: tuple[int, ...], max_tokens: int, step: int) -> list[int]:
    """mlx-lm's `generate_step`, greedy, prefilling `step` tokens at a time."""
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=step)
    return [int(token) for token, _ in steps]


def prefilled_by(h: Harness, requests: list[EngineRequest]) -> int:
    """Run the requests to their end (each by its length); the prompt tokens the engine
    prefilled for them."""
    before = h.core.stats.prompt_tokens
    for r in requests:
        h.submit(r)
    h.run_until(lambda: all(r.request_id in h.out.finished for r in requests))
    assert all(h.out.finished[r.request_id] == "length" for r in requests), h.out.finished
    return h.core.stats.prompt_tokens - before
