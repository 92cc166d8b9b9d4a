"""What machine a benchmark ran on, and the bandwidth bound of its decode.

Run in a child process by the harness (`python -m bench.machine --model llama3-8b --dtype
bfloat16`), so that the harness itself holds no device memory while the servers run. Prints
one JSON object: platform, CPU, `mx.device_info()`, versions, the copy bandwidth MLX reaches
(best of several float32 `a * 1` over a large array: bytes moved = 2 × its size), and the dummy
model's weight bytes. One decode step of one sequence reads every weight once, so
`bandwidth / weight_bytes` is the tokens-per-second ceiling of a single stream.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def our_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("version")), 'version = "?"')
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    v = line.split("=", 1)[1].strip().strip('"')
    return f"{v}+{commit}" if commit else v


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_slug(machine: dict[str, Any]) -> str:
    """A short name for the machine in a results folder's name: `h200`, `cpu`, `apple-m2-max`."""
    if machine.get("backend") == "cpu":
        return "cpu"
    name = str((machine.get("device_info") or {}).get("device_name") or machine.get("backend") or "device")
    name = re.sub(r"^(nvidia|apple)\s+", "", name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def machine_info() -> dict[str, Any]:
    import mlx.core as mx

    info = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
            for k, v in mx.device_info().items()}
    backend = "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else "cpu"
    try:
        import psutil

        ram = int(psutil.virtual_memory().total)
    except ImportError:
        ram = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": ram,
        "backend": backend,
        "default_device": str(mx.default_device()),
        "device_info": info,
    }


def source_digest() -> str:
    """A hash of the code that ran (every .py file of the packages and the bench, by path and
    content). The git commit alone can mislead: a copied working tree may carry a stale
    `.git` (one day's device runs all reported 0893695, also for code committed after
    it). `python -c 'from bench.machine import source_digest; print(source_digest())'`
    on a checkout says whether it is the code a result came from."""
    digest = hashlib.sha256()
    for package in ("engine", "memory", "server", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def versions() -> dict[str, Any]:
    return {"mlx": _version("mlx"), "mlx_lm": _version("mlx-lm"), "mlx_headroom": our_version(),
            "source_digest": source_digest()}


def copy_bandwidth(n_bytes: int, repeats: int = 8) -> dict[str, Any]:
    """Best-of-`repeats` device copy bandwidth in bytes per second (read + write)."""
    import mlx.core as mx

    n = n_bytes // 4
    a = mx.random.uniform(shape=(n,))
    mx.eval(a)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b = a * 1
        mx.eval(b)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
        del b
    best = min(times[1:] or times)
    del a
    mx.clear_cache()
    return {"array_bytes": n * 4, "bytes_moved": n * 8, "best_s": best,
            "bytes_per_s": n * 8 / best, "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="machine info, copy bandwidth, model weight bytes")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype")
    parser.add_argument("--bandwidth-bytes", type=int, default=0, help="0: skip the measurement")
    args = parser.parse_args(argv)
    from engine.dummy_model import dummy_config, weight_bytes

    out: dict[str, Any] = {"machine": machine_info(), "versions": versions()}
    config = dummy_config(args.model, args.dtype)
    out["model"] = {"name": args.model, "dtype": config["torch_dtype"], "weight_bytes": weight_bytes(config),
                    "config": config}
    if args.bandwidth_bytes:
        out["bandwidth"] = copy_bandwidth(args.bandwidth_bytes)
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def result_dir(root: Path, machine: dict[str, Any], name: str, date: str | None = None) -> Path:
    """`<root>/<date>-<machine>-<name>`, with `-2`, `-3` ... when one already exists."""
    base = root / f"{date or time.strftime('%Y-%m-%d')}-{machine_slug(machine)}-{name}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def git_commit() -> str | None:
    """The checkout's commit, for the results it measured (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None

