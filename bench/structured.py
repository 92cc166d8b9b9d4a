"""Per-token cost of constrained decoding: tokens/s at concurrency C with and without a
JSON schema, through our server (streaming chat completions, bench.loadgen).

    python -m bench.structured                       # the embedded tiny model, CPU
    python -m bench.structured --load-format dummy --model llama3-8b --dtype bfloat16 -c 8 -t 256

Three loads, each after a warm-up round of its own (first-use compilation stays out):
`plain` (no schema), `schema` (every request under a schema whose documents are long
enough that no request ends before max_tokens, so both loads generate the same tokens),
and `mixed` (half of the requests under the schema, half plain, decoding in one batch;
the plain half's tokens/s shows what a row without a schema pays beside constrained ones).
ABBA order (plain, schema, schema, plain, ...) over `--rounds` cancels drift.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.loadgen import Workload, run_load
from bench.servers import ROOT, Server

# Every document is an object with a list of at least 4096 small integers: the grammar never
# lets a request finish before max_tokens, so the constrained and plain loads do equal work.
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"values": {"type": "array", "minItems": 4096,
                              "items": {"type": "integer", "minimum": 0, "maximum": 999}}},
    "required": ["values"],
    "additionalProperties": False,
}
MODEL_NAME = "bench-model"


@dataclasses.dataclass(frozen=True)
class SchemaWorkload(Workload):
    """A workload whose requests (all, or every other one) carry a response_format."""

    every: int = 1  # 1: every request; 2: every other one; 0: none

    def constrained(self, index: int) -> bool:
        return self.every > 0 and index % self.every == 0

    def body(self, index: int) -> dict[str, Any]:
        body = super().body(index)
        body["temperature"] = 1.0
        body["seed"] = index
        if self.constrained(index):
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "values", "schema": LONG_SCHEMA}}
        return body


async def _measure(url: str, workload: SchemaWorkload, api_key: str | None) -> dict[str, Any]:
    report = await run_load(url, workload, api_key=api_key)
    summary = report.summary()
    ok = [r for r in report.results if r.outcome == "ok"]
    tokens = sum(r.completion_tokens for r in ok)
    split: dict[str, float] = {}
    if workload.every == 2:
        for name, want in (("constrained", True), ("plain", False)):
            rows = [r for r in ok if workload.constrained(r.index)]
            rows = rows if want else [r for r in ok if not workload.constrained(r.index)]
            split[f"{name}_tokens_per_s_per_request"] = round(
                sum(r.completion_tokens / r.latency_s for r in rows if r.latency_s) / max(len(rows), 1), 2)
    return {"tokens_per_s": round(tokens / report.wall_s, 2), "completion_tokens": tokens,
            "wall_s": round(report.wall_s, 3), "ok": len(ok), "failed": summary.get("failed"),
            "tpot_p50_ms": summary.get("tpot_p50_ms"), **split}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    serve = ["server.cli", "serve", "--model", args.model, "--served-model-name", MODEL_NAME,
             "--log-level", "warning", "--max-concurrency", str(max(args.concurrency, 8))]
    if args.load_format != "auto":
        serve += ["--load-format", args.load_format]
    if args.dtype:
        serve += ["--dtype", args.dtype]
    server = Server("ours", serve, Path(tempfile.gettempdir()) / "mlx-headroom-bench-logs")
    await asyncio.to_thread(server.start, 900.0)
    results: dict[str, list[dict[str, Any]]] = {"plain": [], "schema": [], "mixed": []}
    try:
        base = dict(concurrency=args.concurrency, prompt_tokens=args.prompt_tokens,
                    max_tokens=args.max_tokens, requests=args.requests or args.concurrency * 2,
                    model=MODEL_NAME)
        loads = {"plain": 0, "schema": 1, "mixed": 2}
        first = 0
        for every in loads.values():  # warm-ups, not recorded
            await _measure(server.url, SchemaWorkload(**base, every=every, first_index=first), None)
            first += 1000
        order = ["plain", "schema", "mixed", "mixed", "schema", "plain"] * args.rounds
        for name in order[: 3 * args.rounds]:
            workload = SchemaWorkload(**base, every=loads[name], first_index=first)
            first += 1000
            results[name].append(await _measure(server.url, workload, None))
            print(f"[structured] {name}: {results[name][-1]}", flush=True)
    finally:
        server.stop()

    def mean(name: str, key: str) -> float:
        values = [r[key] for r in results[name] if r.get(key) is not None]
        return round(sum(values) / len(values), 2) if values else 0.0

    plain, schema = mean("plain", "tokens_per_s"), mean("schema", "tokens_per_s")
    return {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "model": args.model, "load_format": args.load_format, "dtype": args.dtype,
        "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "rounds": args.rounds,
        "plain_tokens_per_s": plain, "schema_tokens_per_s": schema,
        "schema_overhead_pct": round((plain / schema - 1) * 100, 1) if schema else None,
        "mixed_tokens_per_s": mean("mixed", "tokens_per_s"),
        "runs": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("-c", "--concurrency", type=int, default=8)
    p.add_argument("-p", "--prompt-tokens", type=int, default=128)
    p.add_argument("-t", "--max-tokens", type=int, default=128)
    p.add_argument("-n", "--requests", type=int, help="per load (default: 2 x concurrency)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                   f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json")
    args = p.parse_args(argv)
    data = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2))
    print(json.dumps({k: v for k, v in data.items() if k != "runs"}, indent=2))
    print(f"[structured] results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
