"""What the HTTP side costs the engine: the same load with and without it, in one run.

    python -m bench.http_cost --model tiny --dtype float32 -c 32 -p 64 -t 200

1. **Engine only**: the engine thread (`EngineClient`, as the server runs it: the server's
   engine config and memory guard, its probe included, unless `--engine-guard allocator`)
   in this process, fed C requests at once by an asyncio loop that only counts outputs:
   no HTTP, no detokenisation, no JSON.
2. **Through HTTP**: our server on the same model, the same requests through
   `bench.loadgen` (streaming chat completions, SSE), in a child process.

For both: output tokens/s and the engine's step time split (busy, device waits, its own
CPU). The gap between the two is what HTTP costs the engine: the event loop's work holds
the GIL the engine thread needs to build each step, and (on a small CPU box) takes cores.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from bench.loadgen import Workload, run_load
from bench.scenarios import engine_split
from bench.servers import Server
from engine import EngineClient, EngineRequest, SamplingParams, load_model
from memory import MemoryGuard
from memory.probes.allocator import AllocatorProbe
from server.app import engine_config, make_guard
from server.settings import Settings


def _split(before: dict[str, Any], after: dict[str, Any], wall: float) -> dict[str, Any]:
    """The benchmark's step split (`bench.scenarios.engine_split`), plus the engine
    thread's own CPU time per step and its busy share of the wall."""
    split = engine_split(before, after, wall)
    steps = max(split["steps"], 1)
    return {**split, "engine_cpu_ms_per_step": round(split["engine_cpu_s"] / steps * 1e3, 3),
            "busy_pct": round(split["busy_s"] / wall * 100, 1)}


async def engine_only(model: str, dtype: str, c: int, p: int, t: int, rounds: int,
                      guard_kind: str = "server") -> dict[str, Any]:
    settings = Settings(max_concurrency=max(c, 1))
    config = engine_config(settings)
    guard = make_guard(settings) if guard_kind == "server" else MemoryGuard(AllocatorProbe())
    client = EngineClient(load=lambda: load_model(model, load_format="dummy", dtype=dtype),
                          guard=guard, config=config, max_queue=4 * c)
    await client.start()
    rng = random.Random(0)
    results = []
    try:
        for r in range(rounds + 1):  # the first round warms up
            before, hand_backs = dataclasses.asdict(client.stats), guard.hand_backs
            started = time.perf_counter()
            streams = [client.submit(EngineRequest(
                f"e{r}-{i}", tuple(rng.randrange(0, 250) for _ in range(p)), t,
                SamplingParams(temperature=0.0))) for i in range(c)]

            async def drain(stream: Any) -> int:
                n = 0
                async for out in stream:
                    n += len(out.new_tokens)
                return n

            tokens = sum(await asyncio.gather(*(drain(s) for s in streams)))
            wall = time.perf_counter() - started
            if r:
                results.append({"tok_s": round(tokens / wall, 1), "wall_s": round(wall, 3),
                                "hand_backs": guard.hand_backs - hand_backs,
                                **_split(before, dataclasses.asdict(client.stats), wall)})
    finally:
        await client.shutdown(5.0)
    return {"runs": results}


async def through_http(model: str, dtype: str, c: int, p: int, t: int, rounds: int) -> dict[str, Any]:
    env = {"MLX_HEADROOM_CACHE": os.environ.get("MLX_HEADROOM_CACHE", "/tmp/mlx-headroom-bench/cache")}
    server = Server("ours", ["server.cli", "serve", "--load-format", "dummy", "--model", model,
                             "--dtype", dtype, "--served-model-name", "bench", "--log-level", "warning",
                             "--max-concurrency", str(max(c, 1))],
                    Path("/tmp/mlx-headroom-bench/logs"), env=env)
    await asyncio.to_thread(server.start, 300)
    results = []
    try:
        import httpx

        async def engine_stats() -> dict[str, Any]:
            async with httpx.AsyncClient() as h:
                r = await h.get(server.url + "/v1/memory", headers=server.headers, timeout=10)
            return dict(r.json()["engine"])

        for r in range(rounds + 1):
            workload = Workload(c, p, t, c, model="bench", first_index=r * 1000)
            before = await engine_stats()
            report = await run_load(server.url, workload, api_key=server.api_key)
            after = await engine_stats()
            s = report.summary()
            if r:
                results.append({"tok_s": s["output_tok_s"], "wall_s": s["wall_s"], "ok": s["ok"],
                                "tpot_ms_p50": s["tpot_ms_p50"], **_split(before, after, s["wall_s"])})
    finally:
        server.stop()
    return {"runs": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=64)
    ap.add_argument("-t", "--max-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engine-guard", choices=["server", "allocator"], default="server",
                    help="engine only: the server's guard and probe, or MLX's allocator counters "
                         "(no device probe: what separates the probe's cost from HTTP's)")
    a = ap.parse_args()
    eng = asyncio.run(engine_only(a.model, a.dtype, a.concurrency, a.prompt_tokens, a.max_tokens, a.rounds,
                                  a.engine_guard))
    http = asyncio.run(through_http(a.model, a.dtype, a.concurrency, a.prompt_tokens, a.max_tokens,
                                    a.rounds))
    best_e = max(r["tok_s"] for r in eng["runs"])
    best_h = max(r["tok_s"] or 0 for r in http["runs"])
    print(json.dumps({"concurrency": a.concurrency, "prompt_tokens": a.prompt_tokens,
                      "engine_guard": a.engine_guard, "max_tokens": a.max_tokens,
                      "engine_only": eng, "through_http": http,
                      "http_cost_pct": round((best_e - best_h) / best_e * 100, 1) if best_e else None},
                     indent=1))


if __name__ == "__main__":
    main()
