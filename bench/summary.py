"""One summary format for every run: `summary.json` in each results folder.

    {"machine": "h200", "commit": "8a104b3", "date": "2026-12-03", "command": "python -m bench ...",
     "rows": [{"server": "ours", "model": "llama3-8b", "dtype": "bf16", "scenario": "throughput",
               "concurrency": 32, "prompt_tokens": 1000, "output_tok_s": 2522.0, "ttft_p50_s": 0.80,
               "failed": 0, "itl_p99_ms": 14.2, "bound_tok_s": 2029.3, ...}, ...]}

One row per measured point. Every row has `ROW_KEYS`; a row has the keys of `OPTIONAL_KEYS`
where its scenario measures them, and may carry more (`stream`, `run`, `dropped`, ...).
`server` is `ours`, `mlx_lm` or `bare` (the bare mlx-lm model's bound, `bench/bound.py`).

`from_run(data)` builds it from a run's `run.json` (the bench writes both after every
scenario); `convert(data)` from the results files earlier versions of the bench wrote (a
`bench.run` JSON, a device-agreement or first memory-truth bench JSON); `validate(summary)` lists what is
wrong with one; `merge` puts several runs' rows in one; `compact(data)` is the per-point
detail of a run for a terminal (`python -m bench summary DIR`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

SERVERS = ("ours", "mlx_lm", "bare")
ROW_KEYS: dict[str, tuple[type, ...]] = {
    "server": (str,), "model": (str,), "dtype": (str,), "scenario": (str,), "concurrency": (int,),
    "prompt_tokens": (int,), "output_tok_s": (float, int, type(None)), "ttft_p50_s": (float, int, type(None)),
    "failed": (int,),
}
OPTIONAL_KEYS: dict[str, tuple[type, ...]] = {
    "prefill_tok_s": (float, int, type(None)), "itl_p99_ms": (float, int, type(None)),
    "hit_over_cold": (float, int, type(None)), "bound_tok_s": (float, int, type(None)),
}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
OLD_SCENARIOS = {"pressure": "overload"}  # earlier names


def dtype_name(dtype: str | None, bits: int | None = None) -> str:
    """`bf16`, `fp32`, ... or `4bit` for a model quantized to 4 bits."""
    return f"{bits}bit" if bits else DTYPES.get(str(dtype), str(dtype))


def _s(ms: float | None) -> float | None:
    return None if ms is None else round(ms / 1000, 4)


def _point_row(base: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """A load's summary (`bench.loadgen.LoadReport.summary`) as a row."""
    row = {**base, "output_tok_s": p.get("output_tok_s"), "ttft_p50_s": _s(p.get("ttft_ms_p50")),
           "failed": int(p.get("failed") or 0), "dropped": int(p.get("dropped") or 0),
           "requests": p.get("requests"), "itl_p99_ms": p.get("itl_ms_p99"),
           "tpot_p50_ms": p.get("tpot_ms_p50"), "steady_tpot_p50_ms": p.get("steady_tpot_ms_p50")}
    if "bound_tok_s" in p:
        row |= {"bound_tok_s": p["bound_tok_s"], "fraction_of_bound": p.get("fraction_of_bound")}
    engine = p.get("engine") or {}
    if engine.get("prefill_tok_s") is not None:
        row["prefill_tok_s"] = engine["prefill_tok_s"]  # while the engine waited on prefill
    if p.get("gpu_busy_pct") is not None:
        row["gpu_busy_pct"] = p["gpu_busy_pct"]
    if p.get("weight_bytes_per_s") is not None:  # a quantized point's steady decode step
        row |= {"weight_gb_s": round(p["weight_bytes_per_s"] / 1e9, 1),
                "weight_bandwidth_fraction": p.get("weight_bandwidth_fraction")}
    return row


def rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a `bench.run` results dict (run.json, or an older one: `convert`)."""
    model = data.get("model") or {}
    sizes = (data.get("settings") or {}).get("sizes") or {}
    name, dtype = str(model.get("name")), dtype_name(model.get("dtype"))
    quantized = data.get("quantized") or {}
    out: list[dict[str, Any]] = []
    for scenario, by_server in (data.get("scenarios") or {}).items():
        scenario = OLD_SCENARIOS.get(scenario, scenario)
        if scenario == "warmup" or not isinstance(by_server, dict):
            continue
        for server, value in by_server.items():
            base = {"server": server, "model": name, "dtype": dtype, "scenario": scenario}
            if isinstance(value, dict) and "error" in value:
                continue
            if scenario in ("throughput", "quantized") and isinstance(value, list):
                if scenario == "quantized":
                    base |= {"model": Path(str(quantized.get("path", name))).name,
                             "dtype": dtype_name(None, quantized.get("bits"))}
                for p in value:
                    out.append(_point_row(base | {"concurrency": int(p["concurrency"]),
                                                  "prompt_tokens": int(sizes.get("prompt_tokens") or 0),
                                                  "max_tokens": sizes.get("max_tokens"),
                                                  "stream": p.get("stream", True),
                                                  "run": p.get("run", "cold")}, p))
            elif scenario == "prefill" and isinstance(value, list):
                for p in value:
                    row = _point_row(base | {"concurrency": 1, "prompt_tokens": int(p["prompt_tokens"])}, p)
                    row["prefill_tok_s"] = p.get("prefill_tok_s")
                    out.append(row)
            elif scenario == "prefix" and isinstance(value, dict):
                out.append(base | {
                    "concurrency": 1,
                    "prompt_tokens": int(value["system_prompt_tokens"] + value["suffix_tokens"]),
                    "output_tok_s": None, "ttft_p50_s": _s(value.get("hit_ttft_ms_p50")), "failed": 0,
                    "hit_over_cold": value.get("hit_over_cold"),
                    "cold_ttft_p50_s": _s(value.get("cold_ttft_ms_p50"))})
            elif scenario == "agent" and isinstance(value, dict):
                ttft = value.get("ttft_ms") or []
                out.append(base | {
                    "concurrency": 1, "prompt_tokens": int(max(value.get("prompt_tokens") or [0])),
                    "output_tok_s": None, "ttft_p50_s": _s(statistics.median(ttft[1:])) if ttft[1:] else None,
                    "failed": 0, "turns": value.get("turns"),
                    "later_turns_prefilled_max": value.get("later_turns_prefilled_max"),
                    "cold_ttft_p50_s": _s(ttft[0]) if ttft else None})
            elif scenario == "prefix-disk" and isinstance(value, dict):
                out.append(base | {
                    "concurrency": 1, "prompt_tokens": int(value["prompt_tokens"]),
                    "output_tok_s": None, "ttft_p50_s": _s(value.get("disk_hit_ttft_ms")), "failed": 0,
                    "cold_ttft_p50_s": _s(value.get("cold_ttft_ms")),
                    "memory_hit_ttft_s": _s(value.get("memory_hit_ttft_ms")),
                    "disk_over_cold": value.get("disk_over_cold")})
            elif scenario == "interference" and isinstance(value, dict):
                alone = value.get("alone") or {}
                out.append(_point_row(base | {"concurrency": int(value["concurrency"]),
                                              "prompt_tokens": int(value["prompt_tokens"]),
                                              "long_prompt_tokens": value.get("long_prompt_tokens"),
                                              "long_ttft_s": _s(value.get("long_ttft_ms")),
                                              "itl_p99_ms_alone": alone.get("itl_ms_p99")}, value)
                           | {"failed": int(value.get("failed") or 0)})
            elif scenario == "overload" and isinstance(value, dict):
                watch = value.get("watch") or {}
                row = _point_row(base | {"concurrency": int(value["requests"]),
                                         "prompt_tokens": int(value["prompt_tokens"])}, value)
                out.append(row | {"ok": value.get("completed_200"), "refused_507": value.get("refused_507"),
                                  "alive_after": watch.get("alive_after"), "peak": watch.get("peak")})
            elif scenario == "guard" and isinstance(value, dict):
                out.append(base | {
                    "concurrency": int(value["concurrency"]), "prompt_tokens": int(value["prompt_tokens"]),
                    "output_tok_s": value.get("on_tok_s"), "ttft_p50_s": None,
                    "failed": sum(int(r.get("failed") or 0) for runs in (value.get("runs") or {}).values()
                                  for r in runs),
                    "off_tok_s": value.get("off_tok_s"), "cost_pct": value.get("cost_pct")})
    for key, scenario in (("bound", "throughput"), ("bound_quantized", "quantized")):
        b = data.get(key)
        if not b:
            continue
        from bench.bound import bound

        requests = {int(r["concurrency"]): r.get("requests") or int(r["concurrency"]) for r in out
                    if r["scenario"] == scenario}
        base_model = next((r["model"] for r in out if r["scenario"] == scenario), name)
        base_dtype = next((r["dtype"] for r in out if r["scenario"] == scenario), dtype)
        for c in b.get("decode_step_ms") or {}:
            point = bound(b, int(c), requests.get(int(c), max(int(c), 2)))
            out.append({"server": "bare", "model": base_model, "dtype": base_dtype, "scenario": scenario,
                        "concurrency": int(c), "prompt_tokens": int(b["prompt_tokens"]),
                        "max_tokens": b.get("max_tokens"), "output_tok_s": point["bound_tok_s"],
                        "ttft_p50_s": point["bound_ttft_p50_s"], "failed": 0,
                        "bound_tok_s": point["bound_tok_s"], "prefill_tok_s": b.get("best_prefill_tok_s"),
                        "decode_step_ms": point["bound_decode_step_ms"]})
    return out


def _commit(data: dict[str, Any]) -> str | None:
    version = str((data.get("versions") or {}).get("mlx_headroom") or "")
    return data.get("commit") or (version.split("+", 1)[1] if "+" in version else None)


def _machine(data: dict[str, Any]) -> str:
    from bench.machine import machine_slug

    return machine_slug(data.get("machine") or {}) if data.get("machine") else "unknown"


def from_run(data: dict[str, Any]) -> dict[str, Any]:
    """summary.json for a run.json."""
    return {"machine": _machine(data), "commit": _commit(data), "date": _date(data.get("started_at")),
            "command": data.get("command"),
            "source_digest": (data.get("versions") or {}).get("source_digest"), "rows": rows(data)}


def _date(stamp: str | None) -> str | None:
    """`2026-12-03` from `20261203-092829` or `2026-12-03T...`."""
    if not stamp:
        return None
    digits = stamp.replace("-", "")[:8]
    return f"{digits[:4]}-{digits[4:6]}-{digits[6:8]}" if digits.isdigit() else None


def convert(data: dict[str, Any], *, machine: str | None = None, commit: str | None = None,
            command: str | None = None, model: str = "llama3-8b", dtype: str = "bf16") -> dict[str, Any]:
    """summary.json for a results file an earlier bench wrote: a `bench.run` JSON (its scenarios
    as here, `pressure` for `overload`, `argv` for the command), or a device-agreement or
    first memory-truth bench's JSON (phases of our server alone; their model is not recorded, so `model` and
    `dtype` name it)."""
    if "scenarios" in data:
        out = from_run(data)
        argv = " ".join(data.get("argv") or [])
        out["command"] = command or out["command"] or f"python -m bench.run {argv}".strip()
        out["date"] = out["date"] or _date(str(data.get("run", "")).split("-", 1)[-1])
        return out | {"machine": machine or out["machine"], "commit": commit or out["commit"]}
    out_rows: list[dict[str, Any]] = []
    model = str(data.get("model") or model)
    dtype = dtype_name(data.get("dtype")) if data.get("dtype") else dtype
    if "goals" in data:  # bench.device_agreement: phases c<C>, long, after_burst
        from bench.scenarios import AGREEMENT_MODES

        mode = AGREEMENT_MODES[data.get("mode", "gpu")]
        shapes = {f"c{c}": ("throughput", c, mode.prompt_tokens) for c in mode.concurrency}
        shapes |= {"long": ("overload", mode.long_requests, mode.long_tokens),
                   "after_burst": ("after_burst", mode.burst_concurrency, mode.prompt_tokens)}
        for phase, entry in (data.get("phases") or {}).items():
            load = entry.get("load") or entry.get("burst")
            if phase not in shapes or not load:
                continue
            scenario, c, tokens = shapes[phase]
            memory = entry.get("memory") or {}
            base = {"server": "ours", "model": model, "dtype": dtype, "scenario": scenario}
            out_rows.append(_point_row(base | {"concurrency": c, "prompt_tokens": tokens}, load)
                            | {k: memory.get(k) for k in ("peak_driver_bytes", "ceiling_at_driver_peak",
                                                          "agreement_max_rel_err") if k in memory})
    else:  # the first memory-truth bench: phases throughput (points by concurrency), pressure, after_burst
        plan = data.get("plan") or {}
        for phase, entry in (data.get("phases") or {}).items():
            value = entry.get("result") if isinstance(entry, dict) else None
            memory = (entry or {}).get("memory") or {}
            extra = {k: memory.get(k) for k in ("driver_peak_bytes", "max_usage_vs_driver_gap")
                     if k in memory}
            base = {"server": "ours", "model": model, "dtype": dtype}
            if phase == "throughput" and isinstance(value, list):
                prompt = int(plan.get("prompt", 0))
                out_rows += [_point_row(base | {"scenario": "throughput",
                                                "concurrency": int(p["concurrency"]),
                                                "prompt_tokens": prompt}, p) for p in value]
            elif phase == "pressure" and isinstance(value, dict) and "requests" in value:
                shape = {"scenario": "overload", "concurrency": int(value["requests"]),
                         "prompt_tokens": int(plan.get("long_prompt", 0))}
                out_rows.append(_point_row(base | shape, value) | extra)
    return {"machine": machine or "unknown", "commit": commit, "date": _date(data.get("started_at")),
            "command": command or " ".join(data.get("argv") or []) or None, "rows": out_rows}


def validate(summary: dict[str, Any]) -> list[str]:
    """What is wrong with a summary (an empty list when nothing is)."""
    header = ("machine", "commit", "date", "command", "rows")
    problems = [f"missing {k!r}" for k in header if k not in summary]
    for i, row in enumerate(summary.get("rows") or []):
        for key, types in ROW_KEYS.items():
            if key not in row:
                problems.append(f"row {i}: missing {key!r}")
            elif not isinstance(row[key], types) or isinstance(row[key], bool):
                problems.append(f"row {i}: {key}={row[key]!r} is not {'/'.join(t.__name__ for t in types)}")
        for key, types in OPTIONAL_KEYS.items():
            if key in row and (not isinstance(row[key], types) or isinstance(row[key], bool)):
                problems.append(f"row {i}: {key}={row[key]!r} is not {'/'.join(t.__name__ for t in types)}")
        if row.get("server") not in SERVERS:
            problems.append(f"row {i}: server {row.get('server')!r} is not one of {SERVERS}")
    return problems


def merge(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' summaries as one: the first's header, every run's rows (each row keeps the
    date and commit of its own run where they differ)."""
    first = summaries[0]
    merged_rows = []
    for s in summaries:
        extra = {k: s.get(k) for k in ("date", "commit") if s.get(k) != first.get(k)}
        merged_rows += [row | extra for row in s.get("rows") or []]
    return {**first, "command": "; ".join(str(s.get("command")) for s in summaries), "rows": merged_rows}


def _steady_ratio(point: dict[str, Any]) -> str:
    """Steady-decode TPOT over the bare model's step at this concurrency."""
    steady, bare = point.get("steady_tpot_ms_p50"), point.get("bound_decode_step_ms")
    return f"{steady / bare:.2f}" if steady and bare else "-"


def _f(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _key(p: dict[str, Any]) -> tuple[int, bool, str]:
    return p["concurrency"], p.get("stream", True), p.get("run", "cold")


def compact(data: dict[str, Any]) -> str:
    """A run's throughput points for a terminal, one line per concurrency × answer mode ×
    cold/warm run: each server's tokens/s and its fraction of the bound, TTFT and TPOT, and for
    ours where the engine step's time went (the device, host work, idle)."""
    tp = data.get("scenarios", {}).get("throughput") or {}
    ours = {_key(p): p for p in tp.get("ours") or [] if isinstance(p, dict) and "concurrency" in p}
    theirs = {_key(p): p for p in tp.get("mlx_lm") or [] if isinstance(p, dict) and "concurrency" in p}
    b = data.get("bound") or {}
    lines = ["", "== throughput summary (" + str(data.get("run")) + ") =="]
    if b:
        steps = ", ".join(f"C={c} {ms} ms" for c, ms in b.get("decode_step_ms", {}).items())
        lines.append(f"bare model: best prefill {b.get('best_prefill_tok_s')} tok/s "
                     f"(batch {b.get('best_prefill_batch')}); decode step at {b.get('decode_context')} "
                     f"tokens of context: {steps}")
    version = data.get("ours_version") or {}
    if version:
        lines.append(f"ours: malloc {version.get('malloc')}, mlx {version.get('mlx')}; "
                     f"the bound's malloc {data.get('bound_malloc') or '-'}; "
                     f"bench process LD_PRELOAD={data.get('bench_ld_preload') or '-'}")
    lines.append("C  mode   run  | bound tok/s | ours tok/s (frac) ok/drop | mlx_lm tok/s (frac) ok/drop "
                 "| ours TTFT p50/p95 ms | ours TPOT p50/p95 ms, steady p50 (x bare step) "
                 "| mlx_lm TTFT p50 / TPOT p50 "
                 "| step ms = device wait + queue + host, idle %, chunks/call | GPU busy % ours/mlx_lm "
                 "| asyncio thread CPU % "
                 "| admission ms/step, hand-backs | prefill tok/s (while the engine waits on it) "
                 "| replayed / sliced steps %, traces")
    for key in sorted(set(ours) | set(theirs), key=lambda k: (k[0], not k[1], k[2])):
        o, t = ours.get(key, {}), theirs.get(key, {})
        c, stream, run = key
        e = o.get("engine") or {}
        limit = _f(o.get("bound_tok_s") or t.get("bound_tok_s"), 1)
        per_call = _f(e.get("chunks_per_prefill_call"), 1)
        lines.append(
            f"{c:<3}{'stream' if stream else 'whole ':<7}{run:<5}| {limit:>11} "
            f"| {_f(o.get('output_tok_s'), 1)} ({_f(o.get('fraction_of_bound'), 3)}) "
            f"{o.get('ok', '-')}/{o.get('dropped', '-')} "
            f"| {_f(t.get('output_tok_s'), 1)} ({_f(t.get('fraction_of_bound'), 3)}) "
            f"{t.get('ok', '-')}/{t.get('dropped', '-')} "
            f"| {_f(o.get('ttft_ms_p50'))}/{_f(o.get('ttft_ms_p95'))} "
            f"| {_f(o.get('tpot_ms_p50'), 1)}/{_f(o.get('tpot_ms_p95'), 1)}, "
            f"{_f(o.get('steady_tpot_ms_p50'), 1)} ({_steady_ratio(o)}) "
            f"| {_f(t.get('ttft_ms_p50'))} / {_f(t.get('tpot_ms_p50'), 1)} "
            f"| {_f(e.get('step_ms'), 1)} = {_f(e.get('device_wait_ms_per_step'), 1)} + "
            f"{_f(e.get('queue_ms_per_step'), 1)} + {_f(e.get('host_ms_per_step'), 1)}, "
            f"{_f(e.get('idle_pct'))}%, {per_call} "
            f"| {_f(o.get('gpu_busy_pct'), 0)}/{_f(t.get('gpu_busy_pct'), 0)} "
            f"| {_f((o.get('cpu') or {}).get('asyncio_thread_pct'), 1)} "
            f"| {_f(e.get('admission_ms_per_step'), 2)}, {e.get('hand_backs', '-')} "
            f"| {_f(e.get('prefill_tok_s'), 0)} "
            f"| {_f(e.get('compiled_pct'), 0)} / {_f(e.get('sliced_pct'), 0)}, {e.get('decode_traces', '-')}"
        )
    errors = data.get("errors") or []
    if errors:
        lines.append("errors: " + "; ".join(errors))
    return "\n".join(lines)


def _run_json(path: Path) -> dict[str, Any]:
    """A results folder's run.json, or a results file itself."""
    return dict(json.loads((path / "run.json" if path.is_dir() else path).read_text()))


def main(argv: list[str] | None = None) -> int:
    """`summary DIR` (compact), `convert FILE... --out DIR`, `merge OUT_DIR DIR...`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("summary", "convert", "merge"):
        raise SystemExit("usage: python -m bench {summary DIR | convert FILE... --out DIR "
                         "| merge OUT_DIR DIR...}")
    verb, rest = argv[0], argv[1:]
    if verb == "summary":
        for path in rest:
            print(compact(_run_json(Path(path))))
        return 0
    if verb == "merge":
        out = Path(rest[0])
        merged = merge([json.loads((Path(d) / "summary.json").read_text()) for d in rest[1:]])
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(merged, indent=1))
        print(out / "summary.json")
        return 0
    p = argparse.ArgumentParser(prog="python -m bench convert",
                                description="older results files as one summary.json (their rows together)")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True, help="the results folder to write summary.json into")
    p.add_argument("--machine", help="e.g. h200 (default: from the files)")
    p.add_argument("--commit", help="the commit the runs ran on (default: from the files' versions)")
    p.add_argument("--command", help="the command that produced them (default: from the files' argv)")
    p.add_argument("--model", default="llama3-8b", help="for files that do not record it")
    p.add_argument("--dtype", default="bf16", help="for files that do not record it")
    args = p.parse_args(rest)
    parts = [convert(json.loads(f.read_text()), machine=args.machine, commit=args.commit,
                     command=args.command, model=args.model, dtype=args.dtype) for f in args.files]
    result = merge(parts) if len(parts) > 1 else parts[0]
    problems = validate(result)
    if problems:
        raise SystemExit("\n".join(problems))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(result, indent=1))
    print(args.out / "summary.json")
    return 0
