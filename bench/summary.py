"""A compact plain-text summary of a results JSON's throughput points, for a terminal:

    python -m bench.summary bench/results/gpu-XXXX.json

One line per concurrency × answer mode × cold/warm run: each server's tokens/s and its
fraction of the bare model's bound (bench/bound.py, measured in the same run), TTFT and
TPOT p50/p95, failures and drops, and for ours where the engine step's time went (the
device, host work, idle) and how busy the asyncio thread (HTTP) was.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _steady_ratio(point: dict[str, Any]) -> str:
    """Steady-decode TPOT over the bare model's step at this concurrency (issue 17: ≤ 1.2)."""
    steady, bare = point.get("steady_tpot_ms_p50"), point.get("bound_decode_step_ms")
    return f"{steady / bare:.2f}" if steady and bare else "-"


def _f(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _key(p: dict[str, Any]) -> tuple[int, bool, str]:
    return p["concurrency"], p.get("stream", True), p.get("run", "cold")


def compact(data: dict[str, Any]) -> str:
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
        bound = _f(o.get("bound_tok_s") or t.get("bound_tok_s"), 1)
        per_call = _f(e.get("chunks_per_prefill_call"), 1)
        lines.append(
            f"{c:<3}{'stream' if stream else 'whole ':<7}{run:<5}| {bound:>11} "
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


if __name__ == "__main__":
    print(compact(json.loads(Path(sys.argv[1]).read_text())))
