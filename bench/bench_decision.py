"""Time MemoryGuard.check (probe read + ceiling + decide + record) on this machine.

    .venv/bin/python bench/bench_decision.py [--calls 10000] [--probe auto]

Prints p50/p99/max in microseconds, and the same for a bare probe read. Goal: p99 < 1 ms.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory import AdmissionQuery, MemoryGuard, detect_probe


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    s = sorted(samples)
    return s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))], s[-1]


def timed(fn: Callable[[], object], calls: int) -> list[float]:
    out: list[float] = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--probe", default="auto")
    args = parser.parse_args()

    probe = detect_probe(args.probe)
    guard = MemoryGuard(probe)
    query = AdmissionQuery(
        predicted_bytes=512 << 20,
        committed_bytes=256 << 20,
        evictable_bytes=1 << 30,
        releasable_bytes=1 << 30,
        request_id="bench",
    )
    for _ in range(200):  # warm up: lazy imports, file caches
        guard.check(query)

    read = timed(probe.read, args.calls)
    check = timed(lambda: guard.check(query), args.calls)
    print(f"probe: {type(probe).__name__}  calls: {args.calls}")
    for name, samples in (("probe.read()", read), ("MemoryGuard.check()", check)):
        p50, p99, worst = percentiles(samples)
        print(f"{name:<20} p50 {p50:8.1f} µs   p99 {p99:8.1f} µs   max {worst:8.1f} µs")
    d = guard.check(query)
    print(f"last decision: {d.outcome.value}: {d.reason}")


if __name__ == "__main__":
    main()
