"""The benchmark scenarios, each an async function of a running server and its parameters that
returns a JSON-ready dict. They talk HTTP only, so they run against ours and mlx_lm.server
alike; what only ours has (`/v1/memory`, `PUT /v1/memory-guard`) is asked for explicitly."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import httpx

from bench.loadgen import LoadReport, Workload, filler, run_load
from bench.servers import Server, Watch


@dataclass(frozen=True)
class Sizes:
    """Scenario sizes; `bench.run.MODES` holds one per mode, flags override fields."""

    concurrency: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    min_requests: int = 2  # per throughput point (C=1 gets this many, one after the other)
    guard_concurrency: int = 8
    guard_rounds: int = 1  # each round is on, off, off, on (ABBA, to cancel drift)
    guard_waves: int = 1  # requests per run = guard_concurrency × guard_waves
    prefix_tokens: int = 2048  # the shared system prompt
    prefix_suffix_tokens: int = 32
    prefix_trials: int = 3  # each: a cold request with a new system prompt, then hits
    prefix_hits: int = 2
    pressure_requests: int = 12
    pressure_prompt_tokens: int = 2048
    pressure_max_tokens: int = 8
    pressure_timeout_s: float = 300.0
    pressure_deadline_s: float = 240.0  # the scenario ends here whatever is left in flight
    request_timeout_s: float = 600.0


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def _load(server: Server, workload: Workload, **kw: Any) -> tuple[LoadReport, dict[str, Any]]:
    async with Watch(server, memory_view=server.name == "ours") as watch:
        report = await run_load(server.url, workload, api_key=server.api_key, **kw)
    return report, watch.summary()


async def warmup(server: Server, model: str, concurrency: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """Short loads at each concurrency: MLX's CUDA backend compiles kernels per shape on first
    use (and caches them on the machine), which would otherwise land in the first measured
    run of each batch size."""
    summary: dict[str, Any] = {}
    for i, c in enumerate(sorted(set(concurrency) | {1})):
        workload = Workload(c, 64, 8, c, model=model, first_index=9_000_000 + i * 1_000)
        report = await run_load(server.url, workload, api_key=server.api_key)
        summary[f"c{c}"] = report.summary()
    return summary


async def throughput(server: Server, model: str, sizes: Sizes) -> list[dict[str, Any]]:
    points = []
    for i, c in enumerate(sizes.concurrency):
        workload = Workload(c, sizes.prompt_tokens, sizes.max_tokens, max(c, sizes.min_requests),
                            model=model, timeout_s=sizes.request_timeout_s, first_index=(i + 1) * 100_000)
        report, watch = await _load(server, workload)
        points.append({"concurrency": c, **report.summary(), "watch": watch})
    return points


async def _set_guard(server: Server, enabled: bool) -> None:
    async with httpx.AsyncClient() as client:
        r = await client.put(server.url + "/v1/memory-guard", json={"enabled": enabled},
                             headers=server.headers, timeout=10.0)
    r.raise_for_status()
    if r.json().get("enabled") is not enabled:
        raise RuntimeError(f"PUT /v1/memory-guard did not set enabled={enabled}: {r.text}")


async def guard_cost(server: Server, model: str, sizes: Sizes) -> dict[str, Any]:
    """Throughput with the memory guard on and off (ours), ABBA-ordered rounds."""
    c = sizes.guard_concurrency
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    shares: list[float] = []  # engine-thread time spent in admission ÷ wall time, guard on
    n = 0
    try:
        for _ in range(sizes.guard_rounds):
            for enabled in (True, False, False, True):
                await _set_guard(server, enabled)
                n += 1
                workload = Workload(c, sizes.prompt_tokens, sizes.max_tokens, c * sizes.guard_waves,
                                    model=model, timeout_s=sizes.request_timeout_s,
                                    first_index=1_000_000 + n * 10_000)
                before = await _memory_view(server)
                report, _ = await _load(server, workload)
                after = await _memory_view(server)
                summary = report.summary()
                if enabled and before and after and summary.get("wall_s"):
                    spent = after["engine"]["admission_s"] - before["engine"]["admission_s"]
                    summary["admission_s"] = round(spent, 4)
                    summary["admission_checks"] = (after["engine"]["admission_checks"]
                                                   - before["engine"]["admission_checks"])
                    shares.append(spent / summary["wall_s"] * 100)
                runs["on" if enabled else "off"].append(summary)
    finally:
        await _set_guard(server, True)
    on = _median([r["output_tok_s"] for r in runs["on"] if r["output_tok_s"]])
    off = _median([r["output_tok_s"] for r in runs["off"] if r["output_tok_s"]])
    cost = round((off - on) / off * 100, 2) if on and off else None
    return {"concurrency": c, "prompt_tokens": sizes.prompt_tokens, "max_tokens": sizes.max_tokens,
            "requests_per_run": c * sizes.guard_waves, "on_tok_s": on, "off_tok_s": off,
            "cost_pct": cost, "goal_pct": 2.0,
            "admission_time_pct": round(_median(shares), 3) if shares else None, "runs": runs}


async def _memory_view(server: Server) -> dict[str, Any] | None:
    if server.name != "ours":
        return None
    async with httpx.AsyncClient() as client:
        r = await client.get(server.url + "/v1/memory", headers=server.headers, timeout=10.0)
    return r.json() if r.status_code == 200 else None


async def prefix_cache(server: Server, model: str, sizes: Sizes) -> dict[str, Any]:
    """TTFT of a request whose long system prompt is cached (a hit) against a cold one. Each
    trial has a new system prompt (distinct from its first character), then `prefix_hits`
    requests with the same system prompt and distinct user messages, one at a time."""
    cold: list[float] = []
    hit: list[float] = []
    before = await _memory_view(server)
    for trial in range(sizes.prefix_trials):
        system = f"{trial:05d} trial system prompt. " + filler(sizes.prefix_tokens, 77 + trial)
        system = system[: sizes.prefix_tokens]
        for k in range(1 + sizes.prefix_hits):
            workload = Workload(1, sizes.prefix_tokens + sizes.prefix_suffix_tokens, 2, 1,
                                system_prompt=system, model=model, timeout_s=sizes.request_timeout_s,
                                first_index=2_000_000 + trial * 1000 + k)
            report = await run_load(server.url, workload, api_key=server.api_key)
            r = report.results[0]
            if r.outcome != "ok" or r.ttft_s is None:
                raise RuntimeError(f"prefix request failed: {report.summary()}")
            (cold if k == 0 else hit).append(r.ttft_s * 1000)
    after = await _memory_view(server)
    cold_p50, hit_p50 = _median(cold), _median(hit)
    out: dict[str, Any] = {
        "system_prompt_tokens": sizes.prefix_tokens,
        "suffix_tokens": sizes.prefix_suffix_tokens,
        "cold_ttft_ms": [round(x, 2) for x in cold],
        "hit_ttft_ms": [round(x, 2) for x in hit],
        "cold_ttft_ms_p50": cold_p50,
        "hit_ttft_ms_p50": hit_p50,
        "hit_over_cold": round(hit_p50 / cold_p50, 4) if cold_p50 and hit_p50 else None,
        "goal_hit_over_cold": 0.15,
    }
    if before and after:
        out["prefix_cache_counters"] = {
            k: after["prefix_cache"].get(k, 0) - before["prefix_cache"].get(k, 0)
            for k in ("hits", "misses", "evictions")
        }
    return out


async def memory_pressure(server: Server, model: str, sizes: Sizes) -> dict[str, Any]:
    """N concurrent long prompts whose KV does not fit at once: what completes, what is refused
    (507), what is dropped; peak memory; whether the server stayed healthy and alive."""
    n = sizes.pressure_requests
    workload = Workload(n, sizes.pressure_prompt_tokens, sizes.pressure_max_tokens, n, model=model,
                        timeout_s=sizes.pressure_timeout_s, first_index=3_000_000)
    report, watch = await _load(server, workload, deadline_s=sizes.pressure_deadline_s)
    summary = report.summary()
    out: dict[str, Any] = {
        "requests": n,
        "prompt_tokens": sizes.pressure_prompt_tokens,
        "max_tokens": sizes.pressure_max_tokens,
        "completed_200": summary["ok"],
        "refused_507": summary["failed_by_status"].get("507", 0),
        **summary,
        "watch": watch,
    }
    view = await _memory_view(server) if server.alive else None
    if view:
        out["memory_after"] = {k: view.get(k) for k in ("usage_bytes", "ceiling", "committed_bytes",
                                                         "kv_bytes", "queue", "engine")}
        out["decisions"] = view.get("decisions", [])[-10:]
    return out
