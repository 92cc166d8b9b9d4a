"""Issue 16's benchmarks in one run: our server on a dummy model, the driver's figure beside ours.

    python -m bench.issue16 --out-dir $OUT                       # H200: llama3-8b bf16
    python -m bench.issue16 --model tiny --dtype float32 --small  # a CPU smoke run, minutes

Phases (each its own key in the results JSON, which is rewritten after every phase):

- `throughput`: C=1/8/32/64 of 1k-token prompts, 256 new tokens (goal: not below 649 / 632
  tok/s at C=32 / 64).
- `reservation`: one 32k-token prompt among 31 1k-token prompts; the largest
  `kv.reserved_bytes` ÷ Σ(own prompt + max_tokens) × `kv.bytes_per_token` seen (goal ≤ 1.15;
  the left-padded batch's formula gives ≈ 14).
- `pressure`: 40 concurrent 32k-token prompts (peak under the ceiling, all answered).
- `after_burst`: C=64 of 1k-token prompts, then one 60k- and one 100k-token prompt, one
  after the other (goal: both 200; before the fix both were refused with 507).

Throughout, a sampler reads every second `nvidia-smi --query-compute-apps=pid,used_memory`
for the server's PID beside `GET /v1/memory` (`usage_bytes`, its source, the ceiling, `kv`),
and reports per phase the peak and the largest relative gap between our `usage_bytes` and
the driver's figure (goal ≤ 5 %). On a machine without nvidia-smi the driver column is empty.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.device_agreement import query_compute_apps
from bench.loadgen import Workload, run_load
from bench.periodic import Periodic
from bench.servers import ROOT, Server, stop_all

API_KEY = "bench-key"
NAME = "bench"


@dataclass(frozen=True)
class Plan:
    prompt: int = 1000
    new_tokens: int = 256
    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    long_prompt: int = 32768
    pressure_requests: int = 40
    after_burst: tuple[int, ...] = (60_000, 100_000)
    timeout_s: float = 900.0


SMALL = Plan(prompt=128, new_tokens=32, concurrency=(1, 8, 32), long_prompt=4096, pressure_requests=8,
             after_burst=(6000, 7000), timeout_s=300.0)


async def driver_used(pid: int) -> int | None:
    """The driver's per-process figure for `pid` (bytes), or None without nvidia-smi or
    when the driver does not list `pid`."""
    apps = await query_compute_apps()
    return None if apps is None else apps.get(pid)


@dataclass
class Sampler(Periodic):
    server: Server
    interval_s: float = 1.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    phase: str = ""
    min_sleep_s: float = 0.05

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(headers=self.server.headers, timeout=5.0)

    async def tick(self, client: httpx.AsyncClient) -> None:
        assert self.server.proc is not None
        sample: dict[str, Any] = {"t": round(time.time(), 2), "phase": self.phase,
                                  "driver_bytes": await driver_used(self.server.proc.pid)}
        try:
            m = (await client.get(self.server.url + "/v1/memory")).json()
            sample.update(usage_bytes=m.get("usage_bytes"), usage_source=m.get("usage_source"),
                          footprint_bytes=m.get("footprint_bytes"),
                          ceiling_bytes=(m.get("ceiling") or {}).get("hard_bytes"),
                          kv=m.get("kv"), queue=m.get("queue"),
                          peak_bytes=(m.get("allocator") or {}).get("peak_bytes"))
        except (httpx.HTTPError, ValueError) as exc:
            sample["error"] = type(exc).__name__
        self.samples.append(sample)

    def summary(self, phase: str) -> dict[str, Any]:
        rows = [s for s in self.samples if s["phase"] == phase]
        driver = [s["driver_bytes"] for s in rows if s.get("driver_bytes")]
        ours = [s["usage_bytes"] for s in rows if s.get("usage_bytes")]
        gaps = [abs(s["usage_bytes"] - s["driver_bytes"]) / s["driver_bytes"] for s in rows
                if s.get("usage_bytes") and s.get("driver_bytes")]
        ceilings = [s["ceiling_bytes"] for s in rows if s.get("ceiling_bytes")]
        return {
            "samples": len(rows),
            "driver_peak_bytes": max(driver, default=None),
            "usage_peak_bytes": max(ours, default=None),
            "min_ceiling_bytes": min(ceilings, default=None),
            "peak_under_ceiling": (max(driver or ours) <= min(ceilings)) if ceilings and (driver or ours)
            else None,
            "max_usage_vs_driver_gap": round(max(gaps), 4) if gaps else None,
            "goal_gap": 0.05,
        }


async def throughput(server: Server, plan: Plan) -> list[dict[str, Any]]:
    points = []
    for i, c in enumerate(plan.concurrency):
        warm = Workload(c, 64, 8, c, model=NAME, first_index=9_000_000 + i * 1000)
        await run_load(server.url, warm, api_key=API_KEY)
        work = Workload(c, plan.prompt, plan.new_tokens, max(c, 2), model=NAME, timeout_s=plan.timeout_s,
                        first_index=(i + 1) * 100_000)
        report = await run_load(server.url, work, api_key=API_KEY)
        points.append({"concurrency": c, **report.summary()})
        print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    return points


async def reservation(server: Server, plan: Plan, sampler: Sampler) -> dict[str, Any]:
    max_tokens = 16
    long = Workload(1, plan.long_prompt, max_tokens, 1, model=NAME, timeout_s=plan.timeout_s,
                    first_index=4_000_000)
    short = Workload(31, plan.prompt, max_tokens, 31, model=NAME, timeout_s=plan.timeout_s,
                     first_index=4_100_000)
    start = len(sampler.samples)
    reports = await asyncio.gather(run_load(server.url, long, api_key=API_KEY),
                                   run_load(server.url, short, api_key=API_KEY))
    results = [r for rep in reports for r in rep.results]
    # the workloads size prompts to these token counts (chat template included)
    own_tokens = plan.long_prompt + max_tokens + 31 * (plan.prompt + max_tokens)
    rows = [s for s in sampler.samples[start:] if s.get("kv")]
    best = max(rows, key=lambda s: s["kv"]["reserved_bytes"], default=None)
    out: dict[str, Any] = {"requests": len(results), "ok": sum(r.outcome == "ok" for r in results),
                           "own_tokens": own_tokens}
    if best:
        per_token = best["kv"]["bytes_per_token"]
        out.update(max_reserved_bytes=best["kv"]["reserved_bytes"], bytes_per_token=per_token,
                   admitted_at_max=(best.get("queue") or {}).get("prefilling", 0)
                   + (best.get("queue") or {}).get("running", 0),
                   ratio=round(best["kv"]["reserved_bytes"] / (own_tokens * per_token), 4), goal=1.15)
    return out


async def pressure(server: Server, plan: Plan) -> dict[str, Any]:
    n = plan.pressure_requests
    work = Workload(n, plan.long_prompt, 16, n, model=NAME, timeout_s=plan.timeout_s, first_index=3_000_000)
    report = await run_load(server.url, work, api_key=API_KEY, deadline_s=plan.timeout_s)
    return report.summary()


async def after_burst(server: Server, plan: Plan) -> dict[str, Any]:
    burst = Workload(64, plan.prompt, plan.new_tokens, 64, model=NAME, timeout_s=plan.timeout_s,
                     first_index=5_000_000)
    out: dict[str, Any] = {"burst": (await run_load(server.url, burst, api_key=API_KEY)).summary()}
    for i, tokens in enumerate(plan.after_burst):
        single = Workload(1, tokens, 16, 1, model=NAME, timeout_s=plan.timeout_s, first_index=6_000_000 + i)
        report = await run_load(server.url, single, api_key=API_KEY)
        r = report.results[0]
        out[f"prompt_{tokens}"] = {"outcome": r.outcome, "status": r.status, "error": r.error,
                                    "ttft_ms": round(r.ttft_s * 1000, 1) if r.ttft_s else None}
    out["goal"] = "every single long prompt answered 200"
    return out


async def main_async(args: argparse.Namespace) -> int:
    plan = SMALL if args.small else Plan()
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"issue16-{time.strftime('%Y%m%d-%H%M%S')}.json"
    server = Server("ours", ["server.cli", "serve", "--load-format", "dummy", "--model", args.model,
                             "--dtype", args.dtype, "--served-model-name", NAME, "--api-key", API_KEY,
                             "--log-level", "warning", "--max-concurrency", "64",
                             "--prefill-step-size", str(args.prefill_step_size), *args.ours_arg],
                    log_dir=out_dir / "logs", api_key=API_KEY)
    data: dict[str, Any] = {"argv": sys.argv[1:], "plan": plan.__dict__, "phases": {}, "errors": []}

    def save() -> None:
        path.write_text(json.dumps(data, indent=1, default=str))

    server.start(timeout_s=600)
    sampler = Sampler(server)
    sampler.start()
    phases = {"throughput": lambda: throughput(server, plan),
              "reservation": lambda: reservation(server, plan, sampler),
              "pressure": lambda: pressure(server, plan),
              "after_burst": lambda: after_burst(server, plan)}
    try:
        for name in args.phases.split(","):
            sampler.phase = name
            print(f"[issue16] {name} ...", file=sys.stderr, flush=True)
            try:
                value: Any = await phases[name]()
            except Exception as exc:  # one phase failing must not lose the others
                value = {"error": f"{type(exc).__name__}: {exc}", "server_log_tail": server.tail()}
                data["errors"].append(f"{name}: {exc}")
            data["phases"][name] = {"result": value, "memory": sampler.summary(name)}
            data["samples"] = sampler.samples
            save()
    finally:
        await sampler.stop()
        data["samples"] = sampler.samples
        data["server_alive_after"] = server.alive
        save()
        server.stop()
    print(path)
    print(json.dumps({k: v["memory"] | {"result": v["result"] if k != "throughput" else
                                        [(p["concurrency"], p.get("output_tok_s")) for p in v["result"]]
                                        if isinstance(v["result"], list) else v["result"]}
                      for k, v in data["phases"].items()}, indent=1, default=str))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--phases", default="throughput,reservation,pressure,after_burst")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--small", action="store_true", help="small sizes, for a CPU smoke run")
    p.add_argument("--ours-arg", action="append", default=[], help="extra flag for our server")
    args = p.parse_args()
    try:
        return asyncio.run(main_async(args))
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
