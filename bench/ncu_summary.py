"""Sum an Nsight Compute CSV of decode steps by kernel: device time, DRAM bytes, bandwidth.

    python -m bench.ncu_summary bench/results/h200-20261202-s8/ncu-b32.csv.gz --steps 2

The CSV comes from `ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes.sum
--csv --print-units base --log-file F python3 -m bench.engine_step ... --steps 2 --profile`
(`bench.cuda_profiler`). ncu runs each kernel alone with its caches flushed and its clocks
locked, so the times are upper bounds and the gaps between kernels are gone: read the shares
and the bandwidths, not the sum, as the step's time.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass
class KernelGroup:
    name: str
    launches: int = 0
    ns: float = 0.0
    dram_bytes: float = 0.0


def read_kernels(path: Path) -> list[dict[str, float | str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    header, body = rows[0], rows[1:]
    col = {h: i for i, h in enumerate(header)}
    kernels: dict[str, dict[str, float | str]] = {}
    for r in body:
        k = kernels.setdefault(r[col["ID"]], {"name": r[col["Kernel Name"]]})
        k[r[col["Metric Name"]]] = float(r[col["Metric Value"]].replace(",", ""))
    return list(kernels.values())


def short_name(name: str) -> str:
    return re.sub(r"<.*", "", name.replace("void ", "").replace("mlx::", ""))[:60]


def group(kernels: list[dict[str, float | str]]) -> list[KernelGroup]:
    groups: dict[str, KernelGroup] = collections.defaultdict(lambda: KernelGroup(""))
    for k in kernels:
        name = short_name(str(k["name"]))
        g = groups[name]
        g.name = name
        g.launches += 1
        g.ns += float(k.get("gpu__time_duration.sum", 0.0))
        g.dram_bytes += float(k.get("dram__bytes.sum", 0.0))
    return sorted(groups.values(), key=lambda g: -g.ns)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("csv", type=Path)
    p.add_argument("--steps", type=float, default=2, help="decode steps the profile covers")
    p.add_argument("--top", type=int, default=16)
    args = p.parse_args(argv)
    groups = group(read_kernels(args.csv))
    ns = sum(g.ns for g in groups)
    dram = sum(g.dram_bytes for g in groups)
    n = args.steps
    print(f"kernels per step {sum(g.launches for g in groups) / n:.0f}, device time per step "
          f"{ns / n / 1e6:.3f} ms, DRAM per step {dram / n / 1e9:.3f} GB ({dram / ns:.0f} GB/s)")
    print("  us/step  share  launches/step   MB/step     GB/s  kernel")
    for g in groups[: args.top]:
        gb_s = g.dram_bytes / g.ns if g.ns else 0.0
        print(f"{g.ns / n / 1e3:9.1f} {100 * g.ns / ns:5.1f}% {g.launches / n:9.1f} "
              f"{g.dram_bytes / n / 1e6:11.1f} {gb_s:8.0f}  {g.name}")


if __name__ == "__main__":
    main()
