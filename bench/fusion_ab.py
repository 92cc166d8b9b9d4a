"""Fused projections (`engine.fusion`) against mlx-lm's separate ones, interleaved in one process.

    python -m bench.fusion_ab --model llama3-8b --dtype bfloat16 --batch 1,32 --context 1024

Two copies of the same dummy model (same seed, so the same weights), one with its q/k/v
and gate/up projections fused. Both decode on one filled KV store in alternating blocks
of steps, so neighbouring blocks see nearly the same host (the H200 guest's host speed
drifts, `bench.step_interleave`); the paired ratio per round is the figure. Also reports
each step graph's primitives (`bench.engine_step.op_census`), a batched prefill call's
time for each, and whether the two pick the same greedy tokens.
"""

from __future__ import annotations

import json
import time
from typing import Any

import mlx.core as mx

from bench.compiled_step import eager_step, fill, run
from bench.engine_step import census_difference, step_census
from bench.host_probe import python_loop_us
from bench.step_interleave import paired, paired_parser
from engine.dummy_model import build_dummy_model, dummy_config
from engine.fusion import fuse_projections
from engine.kv import install_attention_hook


def prefill_ms(model: Any, batch: int, tokens: int, repeats: int = 3) -> float:
    """A plain batched forward over `batch` × `tokens` (no cache): the projections' share
    of prefill, the same for both copies but for the fusion."""
    x = mx.random.randint(0, 256, (batch, tokens))
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        mx.eval(model(x))
        best = min(best, time.perf_counter() - started)
    return round(best * 1e3, 2)


def interleave(models: dict[str, Any], batch: int, context: int, rounds: int, block: int) -> dict[str, Any]:
    store, allocs = fill(models["separate"], batch, context, rounds * len(models) * (block + 2) + 8)
    census = {name: step_census(m, store, allocs) for name, m in models.items()}
    ms: dict[str, list[float]] = {name: [] for name in models}
    tokens: dict[str, list[list[int]]] = {}
    loops: list[float] = []
    for _ in range(rounds):
        loops.append(python_loop_us(rounds=3, n=100_000))
        for name, model in models.items():
            seconds, seen, _ = run(lambda al, t, m=model: eager_step(m, store, al, t), store, allocs, block)
            ms[name].append(round(seconds * 1e3, 3))
            tokens.setdefault(name, seen)
    return {"batch": batch, "context": context, "block_steps": block, **paired(ms, "separate", "fused"),
            "ops": {name: sum(c.values()) for name, c in census.items()},
            "ops_fused_minus_separate": census_difference(census["fused"], census["separate"]),
            "first_block_same_tokens": tokens["separate"] == tokens["fused"],
            "per_round": ms, "py_loop_us": loops}


def main() -> None:
    p = paired_parser(__doc__.split("\n\n")[0])
    p.add_argument("--prefill", default="1x2048,4x1024", help="BxT shapes of a prefill forward to time")
    a = p.parse_args()
    config = dummy_config(a.model, a.dtype)
    models = {"separate": build_dummy_model(config), "fused": build_dummy_model(config)}
    for m in models.values():
        mx.eval(m.parameters())
        install_attention_hook(m)
    report = fuse_projections(models["fused"])
    print(json.dumps({"fused_groups": report.groups, "skipped": report.skipped}), flush=True)
    for shape in filter(None, a.prefill.split(",")):
        b, t = (int(v) for v in shape.split("x"))
        print(json.dumps({"prefill": shape, **{n: prefill_ms(m, b, t) for n, m in models.items()}}),
              flush=True)
    for b in (int(x) for x in a.batch.split(",")):
        print(json.dumps(interleave(models, b, a.context, a.rounds, a.block)), flush=True)


if __name__ == "__main__":
    main()
