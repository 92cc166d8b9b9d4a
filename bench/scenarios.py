"""The benchmark scenarios, each an async function of a running server and its parameters that
returns JSON-ready data, and `SCENARIOS`, the table of them that `python -m bench` offers. They
talk HTTP only, so they run against ours and mlx_lm.server alike; what only ours has
(`/v1/memory`, `PUT /v1/memory-guard`) is asked for explicitly."""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import agent_turns
from bench.loadgen import LoadReport, Workload, filler, run_load
from bench.servers import GpuBusy, Server, Watch


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
    throughput_repeats: int = 1  # 2: each point's first run is cold, the second warm
    stream_modes: tuple[bool, ...] = (True,)  # (True, False): streaming and non-streaming
    prefill_lengths: tuple[int, ...] = (128, 512, 2048)  # prompt tokens, one request at a time
    prefill_repeats: int = 2  # per length; the TTFT's median counts
    interference_concurrency: int = 4  # short streams decoding while one long prompt arrives
    interference_max_tokens: int = 64  # long enough to decode through the long prompt's prefill
    interference_long_tokens: int = 2048
    interference_delay_s: float = 1.0  # the long prompt is sent this long after the short ones
    interference_late_s: float = 0.5  # a short request follows the long prompt by this long
    quantized_bits: int = 4  # the `quantized` scenario's model: mlx-lm's affine quantization
    agent_turns: int = 10  # the `agent` scenario: a conversation of this many turns
    agent_turn_tokens: int = 500  # new user text per turn
    agent_answer_tokens: int = 32


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
    """Each concurrency, in each answer mode (streaming, non-streaming), `throughput_repeats`
    times: the first run of a shape is "cold" (CUDA compiles kernels for new shapes), the
    rest "warm". For ours, where the step's time went (`engine_split`)."""
    points = []
    for i, c in enumerate(sizes.concurrency):
        for stream in sizes.stream_modes:
            for rep in range(sizes.throughput_repeats):
                workload = Workload(c, sizes.prompt_tokens, sizes.max_tokens, max(c, sizes.min_requests),
                                    model=model, timeout_s=sizes.request_timeout_s, stream=stream,
                                    first_index=(i + 1) * 100_000 + rep * 10_000 + (0 if stream else 5_000))
                before = await _memory_view(server)
                cpu_before = _cpu_s(server)
                with GpuBusy() as busy:
                    report, watch = await _load(server, workload)
                after = await _memory_view(server)
                cpu_after = _cpu_s(server)
                summary = report.summary()
                point = {"concurrency": c, "stream": stream, "run": "cold" if rep == 0 else "warm",
                         **summary, "watch": watch, "gpu_busy_pct": busy.percent}
                if cpu_before and cpu_after and summary["wall_s"]:
                    wall = summary["wall_s"]
                    point["cpu"] = {
                        "process_pct": round((cpu_after[0] - cpu_before[0]) / wall * 100, 1),
                        "asyncio_thread_pct": round((cpu_after[1] - cpu_before[1]) / wall * 100, 1),
                    }
                if before and after:
                    point["engine"] = engine_split(before["engine"], after["engine"], summary["wall_s"])
                    point["engine"]["slice_choice"] = after["engine"].get("slice_choice")
                    point["engine"]["hand_backs"] = (after.get("allocator", {}).get("hand_backs", 0)
                                                     - before.get("allocator", {}).get("hand_backs", 0))
                points.append(point)
    return points


_ENGINE_COUNTERS = ("steps", "decode_steps", "prefill_chunks", "prefill_calls", "generated_tokens",
                    "prompt_tokens", "busy_s", "decode_wait_s", "prefill_wait_s", "queue_s", "engine_cpu_s",
                    "admission_checks", "admission_s", "compiled_steps", "decode_traces", "sliced_steps")


def engine_split(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The engine thread's time during one load: waiting for the device (decode steps,
    prefill calls), queueing decode steps (`mx.async_eval`: launches on CUDA; on the CPU
    MLX computes there when too many tasks are in flight), its own host work (the rest of
    its busy time), and idle."""
    d = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in _ENGINE_COUNTERS}
    busy = d["busy_s"]
    waits = d["decode_wait_s"] + d["prefill_wait_s"]
    steps = max(d["steps"], 1)
    return {
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()},
        "step_ms": round(busy / steps * 1e3, 3),
        "device_wait_ms_per_step": round(waits / steps * 1e3, 3),
        "queue_ms_per_step": round(d["queue_s"] / steps * 1e3, 3),
        "host_ms_per_step": round((busy - waits - d["queue_s"]) / steps * 1e3, 3),
        "host_pct_of_busy": round((busy - waits - d["queue_s"]) / busy * 100, 1) if busy else None,
        # part of host work: asking the guard (each question reads the memory probe)
        "admission_ms_per_step": round(d["admission_s"] / steps * 1e3, 3),
        "prefill_tok_s": round(d["prompt_tokens"] / d["prefill_wait_s"], 1) if d["prefill_wait_s"] else None,
        "idle_pct": round(max(wall_s - busy, 0) / wall_s * 100, 1) if wall_s else None,
        "chunks_per_prefill_call": round(d["prefill_chunks"] / d["prefill_calls"], 2)
        if d["prefill_calls"] else None,
        # decode steps replayed from a traced graph (engine.compiled_decode)
        "compiled_pct": round(d["compiled_steps"] / d["decode_steps"] * 100, 1)
        if d["decode_steps"] else None,
        # decode steps that read a lone row as one slice of the pool (engine.kv.attention.run_decode)
        "sliced_pct": round(d["sliced_steps"] / d["decode_steps"] * 100, 1)
        if d["decode_steps"] else None,
    }


def _cpu_s(server: Server) -> tuple[float, float] | None:
    """(the server process's CPU seconds, its main thread's: uvicorn's asyncio loop)."""
    proc = getattr(server, "proc", None)
    if proc is None:
        return None
    try:
        tick = os.sysconf("SC_CLK_TCK")

        def read(path: str) -> float:
            fields = Path(path).read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

        return read(f"/proc/{proc.pid}/stat"), read(f"/proc/{proc.pid}/task/{proc.pid}/stat")
    except (OSError, ValueError, IndexError):
        return None


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
        "goal_hit_over_cold": 0.1,
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


async def prefill_by_length(server: Server, model: str, sizes: Sizes) -> list[dict[str, Any]]:
    """Prefill rate by prompt length: one request at a time of each length, `prefill_repeats`
    times, two new tokens each; prompt tokens over the median TTFT."""
    points = []
    for i, length in enumerate(sizes.prefill_lengths):
        workload = Workload(1, length, 2, sizes.prefill_repeats, model=model,
                            timeout_s=sizes.request_timeout_s, first_index=7_000_000 + i * 1_000)
        report, watch = await _load(server, workload)
        summary = report.summary()
        ttft = [r.ttft_s for r in report.results if r.outcome == "ok" and r.ttft_s is not None]
        median = _median(ttft)
        points.append({"concurrency": 1, "prompt_tokens": length, **summary,
                       "prefill_tok_s": round(length / median, 1) if median else None, "watch": watch})
    return points


async def interference(server: Server, model: str, sizes: Sizes) -> dict[str, Any]:
    """What one long prompt does to short streams already decoding: their inter-token latency
    (ITL) p99 alone, then with a prompt of `interference_long_tokens` sent
    `interference_delay_s` after them, and a short request `interference_late_s` after that.
    A server that prefills the long prompt in one piece stalls every stream for its whole
    prefill; one that chunks it stalls them by a chunk; one that bounds each step's prefill
    by time stalls them by that bound, and serves the late short request before the long
    prompt's remaining chunks. `goals` are the targets (ITL p99, late TTFT, long TTFT over
    idle), met or not; the long prompt's TTFT is
    compared with the same length's alone on the idle server, sent last."""
    c = sizes.interference_concurrency

    def short(first_index: int) -> Workload:
        return Workload(c, sizes.prompt_tokens, sizes.interference_max_tokens, c, model=model,
                        timeout_s=sizes.request_timeout_s, first_index=first_index)

    def one(tokens: int, first_index: int) -> Workload:
        return Workload(1, tokens, 2, 1, model=model, timeout_s=sizes.request_timeout_s,
                        first_index=first_index)

    alone, _ = await _load(server, short(8_000_000))

    async def later(delay_s: float, workload: Workload) -> LoadReport:
        await asyncio.sleep(delay_s)
        return await run_load(server.url, workload, api_key=server.api_key)

    async with Watch(server, memory_view=server.name == "ours") as watch:
        mixed, long_report, late_report = await asyncio.gather(
            run_load(server.url, short(8_200_000), api_key=server.api_key),
            later(sizes.interference_delay_s, one(sizes.interference_long_tokens, 8_100_000)),
            later(sizes.interference_delay_s + sizes.interference_late_s,
                  one(sizes.prompt_tokens, 8_300_000)))
    idle_long = await run_load(server.url, one(sizes.interference_long_tokens, 8_400_000),
                               api_key=server.api_key)
    summary = mixed.summary()
    long_summary, late_summary = long_report.summary(), late_report.summary()
    long_ttft, idle_ttft = long_summary["ttft_ms_p50"], idle_long.summary()["ttft_ms_p50"]
    over_idle = round(long_ttft / idle_ttft, 3) if long_ttft and idle_ttft else None
    measured = {"itl_ms_p99": summary["itl_ms_p99"], "late_short_ttft_ms": late_summary["ttft_ms_p50"],
                "long_ttft_over_idle": over_idle}
    goals = {"itl_ms_p99": 150.0, "late_short_ttft_ms": 500.0, "long_ttft_over_idle": 1.2}
    return {"concurrency": c, "prompt_tokens": sizes.prompt_tokens,
            "max_tokens": sizes.interference_max_tokens,
            "long_prompt_tokens": sizes.interference_long_tokens, **summary,
            "failed": summary["failed"] + long_summary["failed"] + late_summary["failed"],
            "dropped": summary["dropped"] + long_summary["dropped"] + late_summary["dropped"],
            "alone": alone.summary(), "long": long_summary, "late_short": late_summary,
            "long_ttft_ms": long_ttft, "long_idle_ttft_ms": idle_ttft, "goals": goals,
            "goals_met": {k: None if measured[k] is None else measured[k] <= v for k, v in goals.items()},
            **{k: v for k, v in measured.items() if k != "itl_ms_p99"}, "watch": watch.summary()}


@dataclass(frozen=True)
class Scenario:
    """A named scenario: what it measures, the servers it runs against, and its function."""

    name: str
    help: str
    servers: tuple[str, ...]
    run: Callable[[Server, str, Sizes], Awaitable[Any]]
    own_server: bool = False  # ours runs it on a server of its own (other flags, another model)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("throughput", "output tok/s, TTFT and ITL by concurrency, against mlx_lm.server and the "
             "bare mlx-lm model's bound", ("ours", "mlx_lm"), throughput),
    Scenario("prefill", "prefill tok/s (prompt tokens over TTFT) by prompt length, one request at a time",
             ("ours", "mlx_lm"), prefill_by_length),
    Scenario("prefix", "TTFT of a cached long system prompt (a hit) over a cold one",
             ("ours", "mlx_lm"), prefix_cache),
    Scenario("interference", "short streams' ITL p99 while one long prompt arrives, against alone",
             ("ours", "mlx_lm"), interference),
    Scenario("overload", "N long prompts at once whose KV does not fit (40 x 32k on the GPU): answered, "
             "refused (507), dropped, peak memory, alive after", ("ours", "mlx_lm"), memory_pressure,
             own_server=True),
    Scenario("guard", "throughput with the memory guard on and off (ours), ABBA rounds",
             ("ours",), guard_cost),
    Scenario("quantized", "the throughput scenario on the same model quantized by mlx-lm "
             "(--quantized-bits, 4 by default)", ("ours", "mlx_lm"), throughput, own_server=True),
    Scenario("agent", "a conversation growing every turn: tokens reused and prefilled, TTFT per turn",
             ("ours", "mlx_lm"), agent_turns.conversation),
    Scenario("prefix-disk", "a long prompt's TTFT cold, from memory, and from the disk tier after a "
             "restart (--prefix-cache-dir)", ("ours",), agent_turns.disk_restart, own_server=True),
)}


@dataclass(frozen=True)
class AgreementMode:
    """The sizes of `bench.device_agreement`'s phases (our figure beside the driver's)."""

    model: str
    dtype: str
    concurrency: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    long_requests: int
    long_tokens: int
    long_max_tokens: int
    burst_concurrency: int
    after_burst_tokens: tuple[int, ...]
    max_concurrency: int
    startup_timeout_s: float
    request_timeout_s: float


AGREEMENT_MODES = {
    "gpu": AgreementMode("llama3-8b", "bfloat16", (1, 8, 32, 64), 1000, 256, 40, 32768, 16, 64,
                (60_000, 100_000), 64, 600, 900),
    "cpu-tiny": AgreementMode("tiny", "float32", (1, 8), 128, 16, 4, 2048, 4, 8, (3000, 6000), 8, 120, 300),
}
