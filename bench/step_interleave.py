"""Eager against compiled decode steps, interleaved in one process.

    python -m bench.step_interleave --model llama3-8b --dtype bfloat16 --batch 1,32 --context 1024

On the lent H200 (a KVM guest) the host's speed moves by up to 2× from one process to the
next and within one: a fixed pure-Python loop took 14.6 to 35.8 ms, and the decode step,
which is host-bound, followed it (`bench.host_probe`, docs/throughput.md, session 5). A/B runs
in separate processes (`bench.ab`) then need many repeats. Here both paths run on one filled
store in alternating blocks of steps (eager, compiled, eager, ...), so each pair of
neighbouring blocks sees nearly the same host; the paired ratio per round is the figure.
Prints one JSON line per batch size.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import mlx.core as mx

from bench.compiled_step import CompiledStep, eager_step, fill, run
from bench.host_probe import python_loop_us
from engine.dummy_model import build_dummy_model, dummy_config
from engine.fusion import fuse_projections
from engine.kv import install_attention_hook


def interleave(model: Any, batch: int, context: int, rounds: int, block: int) -> dict[str, Any]:
    store, allocs = fill(model, batch, context, rounds * 2 * (block + 2) + 8)
    compiled = CompiledStep(model, store)
    paths = {"eager": lambda al, t: eager_step(model, store, al, t), "compiled": compiled}
    ms: dict[str, list[float]] = {name: [] for name in paths}
    loops: list[float] = []
    for _ in range(rounds):
        loops.append(python_loop_us(rounds=3, n=100_000))
        for name, step in paths.items():
            seconds, _, _ = run(step, store, allocs, block)
            ms[name].append(round(seconds * 1e3, 3))
    return {"batch": batch, "context": context, "block_steps": block, **paired(ms, "eager", "compiled"),
            "traces": compiled.compiled.traces, "per_round": ms, "py_loop_us": loops}


def paired(ms: dict[str, list[float]], base: str, other: str) -> dict[str, Any]:
    """Each path's median ms per step, and the median and range of the per-round ratios
    (neighbouring blocks see nearly the same host, so the ratio is the figure)."""
    ratios = [o / b for b, o in zip(ms[base], ms[other], strict=True)]
    return {f"{base}_ms": statistics.median(ms[base]), f"{other}_ms": statistics.median(ms[other]),
            f"{other}_over_{base}": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}


def paired_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of an interleaved decode-step A/B (this one, `bench.fusion_ab`)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype")
    p.add_argument("--batch", default="1,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=30, help="steps per block")
    return p


def main() -> None:
    p = paired_parser(__doc__.split("\n\n")[0])
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True,
                   help="fuse q/k/v and gate/up first, as the loader does (engine.fusion)")
    a = p.parse_args()
    model = build_dummy_model(dummy_config(a.model, a.dtype))
    mx.eval(model.parameters())
    if a.fuse:
        fuse_projections(model)
    install_attention_hook(model)
    for b in (int(x) for x in a.batch.split(",")):
        print(json.dumps(interleave(model, b, a.context, a.rounds, a.block)), flush=True)


if __name__ == "__main__":
    main()
