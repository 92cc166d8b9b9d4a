"""Sum a `bench.pyspy_server` profile: the engine thread's samples split into waiting on the
device (or the CPU's compute) and host work, by the first frames below `EngineCore.step`.

    python -m bench.pyspy_split OUT/pyspy-c32.txt
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

# Frames where the engine thread waits for evaluation rather than doing host work.
WAITS = ("Runner._queue", "Runner._read_tokens", "Runner.settle", "Runner.prefill (engine/runner.py:103)")
ENGINE_THREAD = "mlx-headroom-engine"


def split(lines: list[str], depth: int = 3) -> tuple[int, int, collections.Counter[str]]:
    """(engine samples, of which waits, host samples by call path)."""
    host: collections.Counter[str] = collections.Counter()
    total = waits = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        if not frames or ENGINE_THREAD not in frames[0]:
            continue
        n = int(count)
        total += n
        if any(w in f for f in frames for w in WAITS):
            waits += n
            continue
        names = [f.split(" (")[0] for f in frames]
        if "EngineCore.step" not in names:
            host["(between steps: the inbox, idle)"] += n
            continue
        i = names.index("EngineCore.step")
        host[" > ".join(names[i + 1:i + 1 + depth]) or "EngineCore.step"] += n
    return total, waits, host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    total, waits, host = split(a.profile.read_text().splitlines())
    print(f"engine thread: {total} samples, {waits} ({waits / max(total, 1):.1%}) waiting on evaluation")
    for path, n in host.most_common(a.top):
        print(f"{n:7d} {n / max(total, 1):6.1%}  {path}")


if __name__ == "__main__":
    main()
