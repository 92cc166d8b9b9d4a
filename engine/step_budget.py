"""A step's prefill while streams decode: how many tokens it may run, and whose come first.

**How many.** Every step that runs prefill lengthens the decoding rows' gap between tokens
by the prefill's time. With a target for that gap (`EngineConfig.max_decode_stall_s`,
`--max-decode-stall-ms`), a step's prefill gets what the target leaves after the decode
step, and that time is turned into tokens by what a prefill token costs at the context it
attends. When no row decodes, nothing is bounded here: prefill runs at full size.

The cost model is a line: a prompt token that attends `c` earlier tokens takes `a + b·c`
seconds, `a` for the weights' matmuls (the same at any context) and `b·c` for attention.
A chunk of `n` tokens starting at context `c` then takes `n·(a + b·(c + n/2))`. Both terms
are fitted online by weighted least squares over the prefill calls the engine runs
(seconds per token against the mean context the call's tokens attended, weighted by its
tokens), older calls fading with a half-life of `HALF_LIFE_CALLS` calls. A long prompt's
chunks attend ever more context, so the line keeps being measured where it is used. A
call far slower than predicted (a kernel compiling on first use) counts as at most
`OUTLIER_FACTOR` times the prediction: one slow call moves the line only so far, a lasting
change moves it over a few calls. The decode step's time is the rest of each step's wall
time, in a running average (the newest step a fifth of it) with the same cap on a slow one.
Until a prefill call has been measured, nothing is cut.

**Whose first.** `prefill_order`: the shortest remaining prefill first, with aging.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from engine.sequence import Sequence

HALF_LIFE_CALLS = 16.0
OUTLIER_FACTOR = 2.0
DECODE_WEIGHT = 0.2  # the newest step's share of the decode step's running average


@dataclass(frozen=True)
class Line:
    """Seconds per prefill token at context c: `per_token_s + per_context_s * c`."""

    per_token_s: float
    per_context_s: float

    def seconds(self, context: int, tokens: int) -> float:
        """A chunk of `tokens` tokens whose first attends `context` earlier ones."""
        return tokens * (self.per_token_s + self.per_context_s * (context + tokens / 2))

    def tokens_within(self, seconds: float, context: int) -> int:
        """The most tokens a chunk starting at `context` runs in `seconds`: the root of
        (b/2)·n² + (a + b·c)·n = seconds, in its cancellation-free form."""
        if seconds <= 0:
            return 0
        k = self.per_token_s + self.per_context_s * context
        if k <= 0:
            return 1 << 30  # nothing measured costs anything: unbounded
        return int(2 * seconds / (k + math.sqrt(k * k + 2 * self.per_context_s * seconds)))


class PrefillCost:
    """The line, fitted online from prefill calls (see the module docstring)."""

    def __init__(self, half_life_calls: float = HALF_LIFE_CALLS) -> None:
        self.keep = 0.5 ** (1 / half_life_calls)
        self.calls = 0
        # decayed sums over calls: weight (tokens), x (mean context), y (seconds per token)
        self._w = self._wx = self._wy = self._wxx = self._wxy = 0.0
        self.line: Line | None = None

    def observe(self, chunks: Iterable[tuple[int, int]], seconds: float) -> None:
        """One prefill call (or one step's calls): each chunk as (context, tokens)."""
        chunks = [(c, n) for c, n in chunks if n > 0]
        tokens = sum(n for _, n in chunks)
        if not tokens or seconds <= 0:
            return
        if self.line is not None:
            seconds = min(seconds, OUTLIER_FACTOR * sum(self.line.seconds(c, n) for c, n in chunks))
        x = sum(n * (c + n / 2) for c, n in chunks) / tokens
        y = seconds / tokens
        keep = self.keep
        self._w = self._w * keep + tokens
        self._wx = self._wx * keep + tokens * x
        self._wy = self._wy * keep + tokens * y
        self._wxx = self._wxx * keep + tokens * x * x
        self._wxy = self._wxy * keep + tokens * x * y
        self.calls += 1
        self.line = self._fit()

    def state(self) -> dict[str, float]:
        """The fit's decayed sums, to carry the measurements into a later process."""
        return {"w": self._w, "wx": self._wx, "wy": self._wy, "wxx": self._wxx, "wxy": self._wxy}

    def restore(self, state: dict[str, float]) -> None:
        """Start from sums `state` saved; new calls weigh in and fade them as they do each other."""
        self._w, self._wx, self._wy = float(state["w"]), float(state["wx"]), float(state["wy"])
        self._wxx, self._wxy = float(state["wxx"]), float(state["wxy"])
        self.line = self._fit() if self._w > 0 and self._wxx > 0 else None

    def _fit(self) -> Line:
        w, mean_x, mean_y = self._w, self._wx / self._w, self._wy / self._w
        var = self._wxx / w - mean_x * mean_x
        slope = (self._wxy / w - mean_x * mean_y) / var if var > 1.0 else 0.0  # contexts < 1 token apart
        slope = max(slope, 0.0)
        intercept = mean_y - slope * mean_x
        if intercept < 0:  # the line through the origin instead
            intercept, slope = 0.0, self._wxy / self._wxx
        return Line(intercept, slope)


class StepBudget:
    """The stall target, the decode step's measured time and the prefill's cost line.

    Per step: `begin(decoding)`, then for each chunk `allow(context)` before it and
    `spend(context, tokens)` once it is planned; after the step's prefill calls ran,
    `observe_prefill`, and once the step ended, `observe_step`."""

    def __init__(self, target_s: float | None, *, floor_tokens: int, quantum_tokens: int = 0) -> None:
        self.target_s = target_s if target_s else None  # None or 0: no bound
        self.floor_tokens = floor_tokens
        # A cut chunk is a multiple of this (above it): where attention is planned per shape
        # (engine.kv.buckets), a cut that follows the line's every move is a new plan per step.
        self.quantum_tokens = quantum_tokens
        self.cost = PrefillCost()
        self.decode_s: float | None = None
        self.bounded_steps = 0  # steps whose prefill the target cut short of the token budget
        self.prior: dict[str, float] | None = None  # an earlier process's fit (`seed`)
        self._left: float | None = None  # seconds of prefill left in this step; None: unbounded
        self._planned = 0  # tokens planned in this step

    def forget(self) -> None:
        """Drop what was measured (after the warm-up: first-use compilation is no cost),
        back to the prior where there is one."""
        self.cost = PrefillCost()
        if self.prior is not None:
            self.cost.restore(self.prior)
        self.decode_s = None

    def seed(self, state: dict[str, float]) -> None:
        """Begin from an earlier process's prefill measurements of this model on this machine
        (`PrefillCost.state`, kept by the prefix cache's disk tier)."""
        self.prior = state
        self.cost.restore(state)

    def begin(self, *, decoding: bool) -> None:
        self._planned = 0
        if self.target_s is None or not decoding or self.cost.line is None:
            self._left = None
            return
        self._left = self.target_s - (self.decode_s or 0.0)

    def allow(self, context: int, budget: int) -> int:
        """Tokens the next chunk, starting at `context`, may run within the step's token
        `budget`. The step's first chunk gets at least `floor_tokens` (prompts always move);
        a later one that would get less gets nothing in this step."""
        line = self.cost.line
        if self._left is None or line is None:
            return budget
        tokens = line.tokens_within(self._left, context)
        if self.quantum_tokens and self.quantum_tokens < tokens < budget:
            tokens -= tokens % self.quantum_tokens
        if tokens < self.floor_tokens:
            # below the floor a chunk costs about what one at the floor costs: the step's
            # first chunk is raised to it (prompts always move), a later one waits
            tokens = 0 if self._planned else self.floor_tokens
        if tokens < budget and not self._planned:
            self.bounded_steps += 1
        return min(tokens, budget)

    def spend(self, context: int, tokens: int) -> None:
        self._planned += tokens
        if self._left is not None and self.cost.line is not None:
            self._left -= self.cost.line.seconds(context, tokens)

    def observe_prefill(self, chunks: Iterable[tuple[int, int]], seconds: float) -> None:
        self.cost.observe(chunks, seconds)

    def observe_step(self, step_s: float, prefill_s: float) -> None:
        """A step that ran a decode step: what it took besides its prefill is the decode
        step's (with the step's own bookkeeping: all of it is the rows' gap)."""
        sample = max(step_s - prefill_s, 0.0)
        if self.decode_s is None:
            self.decode_s = sample
            return
        sample = min(sample, OUTLIER_FACTOR * self.decode_s)
        self.decode_s += DECODE_WEIGHT * (sample - self.decode_s)

    def report(self) -> dict[str, float | int | None]:
        line = self.cost.line
        return {
            "target_ms": None if self.target_s is None else round(self.target_s * 1000, 3),
            "decode_step_ms": None if self.decode_s is None else round(self.decode_s * 1000, 3),
            "prefill_us_per_token": None if line is None else round(line.per_token_s * 1e6, 4),
            "prefill_us_per_token_per_1k_context": (
                None if line is None else round(line.per_context_s * 1e9, 4)),
            "prefill_calls_fitted": self.cost.calls,
            "bounded_steps": self.bounded_steps,
        }


def prefill_order(prefilling: Iterable[Sequence]) -> list[Sequence]:
    """Shortest remaining prefill first, with aging. A prompt's key is its remaining
    prefill less one chunk for every step it was passed over (others ran, it did not): a
    long prompt gives way to shorter ones until it has waited about as long as its own
    prefill takes, then goes first, so it is never starved. Ties keep arrival order."""
    return sorted(prefilling, key=lambda s: s.remaining_prefill - s.passed_over * s.chunk_tokens)
