"""Soak: minutes of mixed traffic against a server this script starts, then leak checks.

Bounded and loopback only. Clients (a fixed number at once) send streaming and
non-streaming chat and text completions, some sharing a long prefix (the prefix cache),
some invalid, and some that hang up mid-stream. Afterwards the engine must be empty
(queue all 0, committed_bytes 0, kv_bytes 0), the prefix cache within its limit, and the
server's RSS must not have grown by more than a bound between the warm mark (20% of the
run) and the end. Prints a JSON summary; exits 1 when a check fails.

    .venv/bin/python -m bench.soak --duration 180
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.loadgen import percentile

ROOT = Path(__file__).resolve().parent.parent
MODEL = "mlx-headroom/tiny-chat"
SHARED_PREFIX = "You are a careful assistant. " * 40
KINDS = (  # (kind, weight)
    ("chat", 25), ("chat_stream", 25), ("completion", 10), ("shared_prefix", 15),
    ("disconnect", 20), ("invalid", 5),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, port: int, log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", str(port),
           "--served-model-name", MODEL]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env},
                            stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 120 s")


def body_for(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    max_tokens = rng.randint(4, 48)
    vocabulary = ["alpha", "beta", "gamma", "delta", "omega"]
    words = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(1, 30)))
    if kind == "completion":
        return "/v1/completions", {"model": MODEL, "prompt": words, "max_tokens": max_tokens,
                                   "stream": rng.random() < 0.5}
    messages = [{"role": "user", "content": words}]
    if kind == "shared_prefix":
        messages.insert(0, {"role": "system", "content": SHARED_PREFIX})
    if kind == "invalid":
        return "/v1/chat/completions", {"model": MODEL, "messages": messages, "temperature": 9}
    if kind == "disconnect":
        max_tokens = 2000  # long enough that hanging up really cuts it short
    return "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": max_tokens,
        "stream": kind in ("chat_stream", "disconnect"), "n": rng.choice([1, 1, 1, 2]),
    }


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random) -> tuple[str, float]:
    path, body = body_for(kind, rng)
    started = time.monotonic()
    if not body.get("stream"):
        r = await client.post(path, json=body)
        return f"{kind}:{r.status_code}", time.monotonic() - started
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return f"{kind}:{r.status_code}", time.monotonic() - started
        chunks = 0
        stop_after = rng.randint(1, 8) if kind == "disconnect" else None
        done = False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                if '"error"' in line:
                    return f"{kind}:error_event", time.monotonic() - started
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    return f"{kind}:hung_up", time.monotonic() - started
    return f"{kind}:{200 if done else 'no_done'}", time.monotonic() - started


async def drive(url: str, duration: float, concurrency: int, seed: int,
                on_tick: Any) -> tuple[Counter[str], list[float]]:
    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    end = time.monotonic() + duration
    kinds, weights = zip(*KINDS, strict=True)

    async def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.monotonic() < end:
                kind = rng.choices(kinds, weights)[0]
                try:
                    outcome, latency = await one(client, kind, rng)
                except httpx.HTTPError as exc:
                    outcome, latency = f"{kind}:transport_error:{type(exc).__name__}", 0.0
                outcomes[outcome] += 1
                if not kind.startswith(("disconnect", "invalid")):
                    latencies.append(latency)

    async def ticker() -> None:
        while time.monotonic() < end:
            on_tick(1 - (end - time.monotonic()) / duration)
            await asyncio.sleep(0.5)

    await asyncio.gather(ticker(), *(worker(i) for i in range(concurrency)))
    return outcomes, latencies


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        memory = httpx.get(url + "/v1/memory", timeout=10).json()
        idle = (sum(memory["queue"].values()) == 0 and memory["committed_bytes"] == 0
                and memory["kv_bytes"] == 0)
        if idle or time.monotonic() > deadline:
            return memory
        time.sleep(0.2)


def soak(*, duration: float, concurrency: int, model: str, seed: int, rss_growth_mib: float,
         log_path: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MLX_HEADROOM_LOG_LEVEL": "warning", "MLX_HEADROOM_MAX_QUEUE": "64"}
    proc = start_server(model, port, log_path, env)
    server = psutil.Process(proc.pid)
    mib = 1 << 20
    rss = {"start_mib": server.memory_info().rss / mib, "warm_mib": None, "peak_mib": 0.0}

    def on_tick(progress: float) -> None:
        current = server.memory_info().rss / mib
        rss["peak_mib"] = max(rss["peak_mib"], current)
        if rss["warm_mib"] is None and progress >= 0.2:
            rss["warm_mib"] = current

    try:
        started = time.monotonic()
        outcomes, latencies = asyncio.run(drive(url, duration, concurrency, seed, on_tick))
        elapsed = time.monotonic() - started
        memory = wait_idle(url)
        rss["end_mib"] = server.memory_info().rss / mib
    finally:
        proc.terminate()
        try:
            exit_code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = proc.wait()

    warm = rss["warm_mib"] if rss["warm_mib"] is not None else rss["start_mib"]
    # The KV pool left once nothing runs is the prefix cache's, kept on purpose (the guard
    # owns its budget and no cap is set by default): growth beyond it is what would leak.
    pool_mib = memory["kv"]["pool_bytes"] / 2**20
    growth = rss["end_mib"] - warm - pool_mib
    prefix = memory["prefix_cache"]
    failures = [k for k in outcomes if k.endswith((":500", ":no_done", ":error_event"))
                or "transport_error" in k]
    checks = {
        "queue_empty": sum(memory["queue"].values()) == 0,
        "committed_bytes_zero": memory["committed_bytes"] == 0,
        "kv_bytes_zero": memory["kv_bytes"] == 0,
        # an operator's cap, or what the guard leaves the cache (no cap: the default)
        "prefix_cache_within_limit": prefix["bytes"] <= (
            prefix["max_bytes"] if prefix["max_bytes"] is not None else prefix["budget_bytes"]),
        "rss_growth_within_bound": growth < rss_growth_mib,
        "no_failed_requests": not failures,
        "clean_exit": exit_code == 0,
    }
    return {
        "duration_s": round(elapsed, 1),
        "concurrency": concurrency,
        "requests": sum(outcomes.values()),
        "requests_per_s": round(sum(outcomes.values()) / elapsed, 2),
        "outcomes": dict(sorted(outcomes.items())),
        "latency_s": {"p50": _round(percentile(latencies, 50)), "p95": _round(percentile(latencies, 95))},
        "rss_mib": {k: _round(v, 1) for k, v in rss.items()} | {"growth_after_warm": round(growth, 1),
                                                                  "kv_pool": round(pool_mib, 1),
                                                                  "bound": rss_growth_mib},
        "engine_after": {"queue": memory["queue"], "committed_bytes": memory["committed_bytes"],
                         "kv_bytes": memory["kv_bytes"]},
        "prefix_cache": {k: prefix[k] for k in ("bytes", "max_bytes", "budget_bytes", "entries", "hits",
                                                "misses", "evictions")},
        "server_exit_code": exit_code,
        "checks": checks,
        "ok": all(checks.values()),
    }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of traffic (default 180)")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--model", default="tiny", help="model to serve (default: the tiny model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-growth-mib", type=float, default=64.0,
                        help="most the server's RSS may grow between the 20%% mark and the end")
    parser.add_argument("--log", type=Path, help="where the server's log goes (default: a temp file)")
    args = parser.parse_args(argv)
    log_path = args.log or Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    summary = soak(duration=args.duration, concurrency=args.concurrency, model=args.model,
                   seed=args.seed, rss_growth_mib=args.rss_growth_mib, log_path=log_path)
    summary["server_log"] = str(log_path)
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
