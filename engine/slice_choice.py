"""Which path a lone decoding row takes where decode steps are replayed: the slice or the graph.

A lone row on one run of blocks can be read as one slice of the pool by MLX's fused SDPA
(engine.kv.attention.run_decode). That step's view length is in its shapes, so it runs
eagerly; the paged step replays a traced graph (engine.compiled_decode). On the H200 the
slice spends about 1 ms less on the device and about 1 ms more on the host per step, so which
one is faster depends on the host: in the server at C=1 the slice won by 13 % on one lent
machine and lost by 6 % on another (docs/throughput.md). Rather than guess,
the engine times both on the first lone rows it serves and keeps the faster.

A first answer does not stay true. On one H200 host the slice won its trial (5.5 against
5.8 ms) and then slowed, request after request, to 10.7 ms a step while the graph would have
held 5.8 (docs/throughput.md). So the chosen path stays watched: each window of
`WATCH_STEPS` samples is compared with the other path's trial, and a window slower than that
by `RETRY_MARGIN` times both paths again.

The two paths take turns during a trial, `TRIAL_TURN` samples at a time, in the order slice,
graph, graph, slice (and again): a host whose speed drifts while the trial runs then weighs
on both paths alike. A trial that timed the slice's 24 steps first and the graph's next
confounded the path with the moment. On one H200 host it kept the graph (5.47 against
5.78 ms), and then the graph stepped in 5.6-6.0 ms. Forced, the same host's slice stepped
in 5.3-5.4 ms in three windows of four (docs/throughput.md).

A sample is the time from one step's start to the next's, between two steps of the same
path (so a step in flight from the other path is not counted), and for the graph only
between replays (not the eager steps before a trace, nor the trace).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

TRIAL_STEPS = 24  # samples per path: 48 steps, a fifth of one 256-token request
TRIAL_TURN = 6  # samples per turn: slice, graph, graph, slice, ... (4 turns each)
TURNS = (True, False, False, True)  # ABBA: a steady drift cancels in each group of four
WATCH_STEPS = 64  # samples of the chosen path per comparison with the other's trial
RETRY_MARGIN = 0.10  # a window this much slower than the other path's trial: time both again


@dataclass
class SliceChoice:
    trial_steps: int = TRIAL_STEPS
    trial_turn: int = TRIAL_TURN
    watch_steps: int = WATCH_STEPS
    retry_margin: float = RETRY_MARGIN
    samples: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    chosen: bool | None = None  # True: the slice; None: still timing
    watched: list[float] = field(default_factory=list)  # the chosen path's current window
    retrials: int = 0
    last_retrial: dict[str, object] | None = None  # the window that started the latest one

    def next_sliced(self) -> bool:
        """The path for the next lone-row step: the chosen one, else the path whose turn it
        is in the trial (a path whose samples are all in gives its turns to the other)."""
        if self.chosen is not None:
            return self.chosen
        sliced, paged = (len(self.samples[k]) for k in (True, False))
        if sliced >= self.trial_steps or paged >= self.trial_steps:
            return sliced < self.trial_steps
        return TURNS[(sliced + paged) // max(self.trial_turn, 1) % len(TURNS)]

    def record(self, sliced: bool, seconds: float) -> None:
        if self.chosen is not None:
            if sliced == self.chosen:
                self._watch(seconds)
            return
        kept = self.samples[sliced]
        if len(kept) < self.trial_steps:
            kept.append(seconds)
        if all(len(v) >= self.trial_steps for v in self.samples.values()):
            self.chosen = self.median_ms(True) <= self.median_ms(False)

    def _watch(self, seconds: float) -> None:
        self.watched.append(seconds)
        if len(self.watched) < self.watch_steps:
            return
        window_ms = statistics.median(self.watched) * 1e3
        self.watched = []
        other_ms = self.median_ms(not self.chosen)
        if other_ms is not None and window_ms > other_ms * (1 + self.retry_margin):
            self.last_retrial = {"path": _name(self.chosen), "window_ms": round(window_ms, 3),
                                 "other_trial_ms": other_ms}
            self.retrials += 1
            self.chosen = None
            self.samples = {True: [], False: []}

    def median_ms(self, sliced: bool) -> float | None:
        kept = self.samples[sliced]
        return round(statistics.median(kept) * 1e3, 3) if kept else None

    def report(self) -> dict[str, object]:
        """The numbers behind the choice (GET /v1/memory's engine stats, the log)."""
        return {"slice_ms": self.median_ms(True), "paged_ms": self.median_ms(False),
                "samples": self.trial_steps, "chosen": _name(self.chosen),
                "retrials": self.retrials, "last_retrial": self.last_retrial}


def _name(chosen: bool | None) -> str | None:
    return None if chosen is None else ("slice" if chosen else "paged")
