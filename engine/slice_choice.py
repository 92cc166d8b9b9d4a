"""Which path a lone decoding row takes where decode steps are replayed: the slice or the graph.

A lone row on one run of blocks can be read as one slice of the pool by MLX's fused SDPA
(engine.kv.attention.run_decode). That step's view length is in its shapes, so it runs
eagerly; the paged step replays a traced graph (engine.compiled_decode). On the H200 the
slice spends about 1 ms less on the device and about 1 ms more on the host per step, so which
one is faster depends on the host: in the server at C=1 the slice won by 13 % on one lent
machine and lost by 6 % on another (docs/throughput.md, session 12). Rather than guess,
the engine times both on the first lone rows it serves and keeps the faster.

A sample is the time from one step's start to the next's, between two steps of the same
path (so a step in flight from the other path is not counted), and for the graph only
between replays (not the eager steps before a trace, nor the trace).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

TRIAL_STEPS = 24  # samples per path: 48 steps, a fifth of one 256-token request


@dataclass
class SliceChoice:
    trial_steps: int = TRIAL_STEPS
    samples: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    chosen: bool | None = None  # True: the slice; None: still timing

    def next_sliced(self) -> bool:
        """The path for the next lone-row step: the chosen one, else the slice until its
        samples are in, then the graph."""
        if self.chosen is not None:
            return self.chosen
        return len(self.samples[True]) < self.trial_steps

    def record(self, sliced: bool, seconds: float) -> None:
        if self.chosen is not None:
            return
        kept = self.samples[sliced]
        if len(kept) < self.trial_steps:
            kept.append(seconds)
        if all(len(v) >= self.trial_steps for v in self.samples.values()):
            self.chosen = self.median_ms(True) <= self.median_ms(False)

    def median_ms(self, sliced: bool) -> float | None:
        kept = self.samples[sliced]
        return round(statistics.median(kept) * 1e3, 3) if kept else None

    def report(self) -> dict[str, object]:
        """The numbers behind the choice (GET /v1/memory's engine stats, the log)."""
        return {"slice_ms": self.median_ms(True), "paged_ms": self.median_ms(False),
                "samples": self.trial_steps,
                "chosen": None if self.chosen is None else ("slice" if self.chosen else "paged")}
