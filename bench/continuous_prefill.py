"""Prefill under a continuous load, engine only: where a closed loop's prompts spend their time.

    python -m bench.continuous_prefill --model llama3-8b --dtype bfloat16 -c 32 -n 192

A closed loop (a new request as each one ends, as `bench.loadgen -n` drives a server) makes
every prompt prefill beside running decode rows, where the benchmark's waves prefill a burst
and then decode. Through the server on the H200 such a load spent most of the engine
thread's time inside prefill evaluations (docs/throughput.md, session 6). This runs the
same pattern on an `EngineCore` in this process, with the server's defaults for the backend
and the model fused as the loader does, and times every prefill model call: its chunks,
its padded shape, whether that shape was new to the process (CUDA compiles kernels per
shape), and its wall time; and every decode step by its batch size, first use or not.
`--jitter` varies prompt lengths (distinct shapes).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from engine import EngineConfig, EngineCore, EngineRequest, SamplingParams, load_model
from engine.runner import Runner
from engine.warmup import warm_up
from memory import MemoryGuard
from memory.probes.allocator import AllocatorProbe


class PrefillTimer:
    """Wraps `Runner.prefill` to record each call's shape and wall time."""

    def __init__(self, runner: Runner) -> None:
        self.calls: list[dict[str, Any]] = []
        self._seen: set[tuple[int, int]] = set()
        self._batches: set[int] = set()  # decode batch sizes seen when a prefill call started
        self._runner = runner
        self._inner = runner.prefill
        runner.prefill = self  # type: ignore[method-assign]

    def __call__(self, chunks: Any) -> int:
        shape = (len(chunks), max(t for _, t in chunks))
        decoding = len(self._runner.seqs)  # the queued decode step's batch, which settle() waits for
        started = time.perf_counter()
        calls = self._inner(chunks)
        self.calls.append({"rows": shape[0], "tokens": sum(t for _, t in chunks), "padded": shape[1],
                           "new_shape": shape not in self._seen, "decoding": decoding,
                           "new_decode_batch": decoding not in self._batches,
                           "ms": round((time.perf_counter() - started) * 1e3, 2)})
        self._seen.add(shape)
        self._batches.add(decoding)
        return calls


class DecodeTimer:
    """Wraps `Runner.step` to time each decode step by its batch size, first use or not.

    With overlap (CUDA) a step queues its own work and reads the previous step's tokens,
    so a first use's cost can land in the step after it; both are reported."""

    def __init__(self, runner: Runner) -> None:
        self.steps: list[tuple[int, bool, float]] = []  # (batch, first use of that size, ms)
        self.shrank: list[bool] = []  # rows left since the previous step (its tokens are gathered)
        self._seen: set[int] = set()
        self._runner = runner
        self._last_emitting = 0
        self._inner = runner.step
        runner.step = self  # type: ignore[method-assign]

    def __call__(self) -> Any:
        batch = len(self._runner.seqs)
        self.shrank.append(bool(self.steps) and self._runner.pending is not None
                           and self._runner.pending.tokens.shape[0] < self._last_emitting)
        started = time.perf_counter()
        out = self._inner()
        self._last_emitting = batch
        self.steps.append((batch, batch not in self._seen, (time.perf_counter() - started) * 1e3))
        self._seen.add(batch)
        return out

    def summary(self) -> dict[str, Any]:
        first = [ms for _, new, ms in self.steps if new]
        after_first = [self.steps[i + 1][2] for i, (_, new, _) in enumerate(self.steps[:-1]) if new]
        slowest = sorted(enumerate(self.steps), key=lambda step: -step[1][2])[:5]
        rest = [ms for i, (_, new, ms) in enumerate(self.steps)
                if not new and (i == 0 or not self.steps[i - 1][1])]
        return {"decode_batch_sizes": len(self._seen), "first_use_ms_p50": _median(first),
                "first_use_ms_max": round(max(first), 1) if first else None,
                "step_after_first_use_ms_p50": _median(after_first), "other_steps_ms_p50": _median(rest),
                "first_use_total_s": round(sum(first) / 1e3, 2),
                "slowest_steps": [{"index": i, "batch": b, "first_use": new, "after_a_leave": self.shrank[i],
                                   "ms": round(ms, 1)} for i, (b, new, ms) in slowest]}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _rank_ms(ordered: list[float], q: float) -> float | None:
    """The q-quantile of sorted seconds, in ms, taken at rank int(n * q) (no interpolation)."""
    return round(ordered[int(len(ordered) * q)] * 1e3, 1) if ordered else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype")
    p.add_argument("-c", "--concurrency", type=int, default=32)
    p.add_argument("-n", "--requests", type=int, default=192)
    p.add_argument("-p", "--prompt-tokens", type=int, default=1000)
    p.add_argument("-t", "--max-tokens", type=int, default=256)
    p.add_argument("--jitter", type=int, default=0, help="prompt lengths vary by up to this many tokens")
    p.add_argument("--warm-up", action="store_true", help="run the server's start-up warm-up first")
    a = p.parse_args()
    loaded = load_model(a.model, load_format="dummy", dtype=a.dtype)
    from server.settings import backend_defaults

    defaults = backend_defaults()
    core = EngineCore(loaded, MemoryGuard(AllocatorProbe(), enabled=False),
                      EngineConfig(prefill_step_size=defaults.prefill_step_size,
                                   max_concurrency=defaults.max_concurrency), lambda outs: None)
    warmup_s = warm_up(core).seconds if a.warm_up else 0.0
    timer = PrefillTimer(core.batch)
    decode = DecodeTimer(core.batch)
    rng = random.Random(0)
    submitted: dict[str, float] = {}
    first_token: dict[str, float] = {}
    done = 0

    def submit(i: int) -> None:
        n = a.prompt_tokens + (rng.randint(-a.jitter, a.jitter) if a.jitter else 0)
        rid = f"q{i}"
        submitted[rid] = time.perf_counter()
        core.submit(EngineRequest(rid, tuple(rng.randrange(0, 256) for _ in range(n)), a.max_tokens,
                                  SamplingParams(temperature=0.0)))

    def publish(outputs: list[Any]) -> None:
        nonlocal done
        now = time.perf_counter()
        for out in outputs:
            if out.new_tokens and out.request_id not in first_token:
                first_token[out.request_id] = now
            if out.finish_reason is not None:
                done += 1
                if len(submitted) < a.requests:
                    submit(len(submitted))

    core.publish = publish
    for i in range(a.concurrency):
        submit(i)
    started = time.perf_counter()
    while done < a.requests:
        core._drain_inbox(timeout=0)
        core.step()
    wall = time.perf_counter() - started
    ttft = sorted(first_token[r] - submitted[r] for r in submitted)
    # The first wave queues behind its own burst; the later ones arrive one by one.
    later = sorted(first_token[f"q{i}"] - submitted[f"q{i}"] for i in range(a.concurrency, a.requests))
    calls = timer.calls
    steady = calls[len(calls) // 4:]  # past the first burst
    prefill_ms = sum(c["ms"] for c in calls)
    print(json.dumps({
        "backend": loaded.backend, "concurrency": a.concurrency, "requests": a.requests,
        "jitter": a.jitter, "warmup_s": round(warmup_s, 2), "wall_s": round(wall, 2),
        "output_tok_s": round(a.requests * a.max_tokens / wall, 1),
        "ttft_ms_p50": _rank_ms(ttft, 0.5), "ttft_ms_p95": _rank_ms(ttft, 0.95),
        "ttft_ms_first_wave_max": round(max(first_token[f"q{i}"] - submitted[f"q{i}"]
                                            for i in range(a.concurrency)) * 1e3, 1),
        "ttft_ms_later_p50": _rank_ms(later, 0.5), "ttft_ms_later_p95": _rank_ms(later, 0.95),
        "prefill_calls": len(calls), "prefill_s": round(prefill_ms / 1e3, 2),
        "prefill_tok_s": round(sum(c["tokens"] for c in calls) * 1e3 / max(prefill_ms, 1e-9)),
        "call_ms_new_shape_p50": _median([c["ms"] for c in steady if c["new_shape"]]),
        "call_ms_seen_shape_p50": _median([c["ms"] for c in steady if not c["new_shape"]]),
        "new_shapes": sum(c["new_shape"] for c in calls),
        "decode_steps": core.stats.decode_steps, "compiled_steps": core.stats.compiled_steps,
        "decode_traces": core.stats.decode_traces, **decode.summary(),
        "decode_wait_s": round(core.batch.decode_wait_s, 2), "queue_s": round(core.batch.queue_s, 2),
        "slow_calls": [dict(c, index=i) for i, c in enumerate(calls) if c["ms"] > 300][:20],
    }), flush=True)


if __name__ == "__main__":
    main()
