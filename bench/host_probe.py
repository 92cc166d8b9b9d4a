"""How fast this process's CPU is right now, and where it runs.

On CUDA the decode step is paced by the host (Python builds the graph, MLX encodes each op,
and completions come back through a callback thread), so a process that lands on a slow or
remote core steps slower. `bench.engine_step` records these beside each run, so that
`bench.ab` can tell a slow host from a slow configuration.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


def python_loop_us(rounds: int = 7, n: int = 200_000) -> float:
    """Median time of a fixed pure-Python loop (list appends, dict writes, int arithmetic)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        acc: dict[int, int] = {}
        items: list[int] = []
        for i in range(n):
            items.append(i * 3 % 7)
            acc[i & 255] = i
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def current_cpu() -> int | None:
    """The CPU this thread ran on last (field 39 of /proc/self/stat), None off Linux."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[36])


def numa_node(cpu: int | None) -> int | None:
    if cpu is None:
        return None
    nodes = sorted(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node*"))
    return int(nodes[0].name[4:]) if nodes else None


def host_probe() -> dict[str, float | int | None]:
    cpu = current_cpu()
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"py_loop_us": python_loop_us(), "cpu": cpu, "numa_node": numa_node(cpu),
            "cpus_allowed": allowed}
