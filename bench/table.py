"""A run as a markdown table: `python -m bench table bench/results/<folder>` (its run.json)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.bound import physical, physical_tok_s, prefill_flops_per_token

NAMES = {"ours": "mlx-headroom", "mlx_lm": "mlx_lm.server"}


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int) and abs(value) >= 1 << 20:
        return f"{value / 2**30:.2f} GiB" if value >= 1 << 30 else f"{value / 2**20:.0f} MiB"
    return str(value)


def _outcomes(r: dict[str, Any]) -> str:
    failed = ", ".join(f"{k}×{v}" for k, v in (r.get("failed_by_status") or {}).items())
    dropped = ", ".join(f"{k}×{v}" for k, v in (r.get("dropped_by_reason") or {}).items())
    text = f"{r.get('ok', 0)}/{r.get('requests', 0)} ok"
    if failed:
        text += f"; failed {failed}"
    if dropped:
        text += f"; dropped {dropped}"
    return text


def _peak(r: dict[str, Any]) -> str:
    peak = (r.get("watch") or {}).get("peak") or {}
    parts = [f"{label} {_fmt(peak[key])}" for key, label in
             (("usage_bytes", "MLX"), ("gpu_used_bytes", "GPU"), ("rss_bytes", "RSS")) if key in peak]
    return ", ".join(parts) or "–"


def markdown(data: dict[str, Any]) -> str:
    sc = data.get("scenarios", {})
    servers = [s for s in ("ours", "mlx_lm") if any(s in v for v in sc.values())]
    model = data.get("model", {})
    machine = data.get("machine", {})
    info = machine.get("device_info", {})
    versions = data.get("versions", {})
    lines = [
        f"**{data.get('run')}**: {model.get('name')} ({model.get('dtype')}, "
        f"{_fmt(model.get('weight_bytes'))} of weights) on {info.get('device_name') or machine.get('cpu')} "
        f"({machine.get('backend')}); mlx {versions.get('mlx')}, mlx-lm {versions.get('mlx_lm')}, "
        f"mlx-headroom {versions.get('mlx_headroom')}",
        "",
        "| scenario | metric | " + " | ".join(NAMES[s] for s in servers) + " |",
        "|---|---|" + "---|" * len(servers),
    ]

    def row(scenario: str, metric: str, values: list[str]) -> None:
        lines.append(f"| {scenario} | {metric} | " + " | ".join(values) + " |")

    sizes = data.get("settings", {}).get("sizes", {})
    phys = physical(data)
    for c, points in _by_concurrency(sc.get("throughput", {}), servers):
        label = f"throughput C={c}, P={sizes.get('prompt_tokens')}, T={sizes.get('max_tokens')}"
        limit = {s: physical_tok_s(phys, prompt_tokens=sizes["prompt_tokens"], max_tokens=sizes["max_tokens"],
                                   concurrency=c, requests=points[s]["requests"])
                 if phys and points[s].get("requests") else None for s in servers}
        row(label, "output tok/s (÷ physical bound)",
            [_fmt(points[s].get("output_tok_s")) + _share(points[s].get("output_tok_s"), limit[s])
             for s in servers])
        row(label, "TTFT p50 / p95 ms", [f"{_fmt(points[s].get('ttft_ms_p50'), 0)} / "
                                        f"{_fmt(points[s].get('ttft_ms_p95'), 0)}" for s in servers])
        row(label, "TPOT p50 / p95 ms", [f"{_fmt(points[s].get('tpot_ms_p50'))} / "
                                        f"{_fmt(points[s].get('tpot_ms_p95'))}" for s in servers])
        row(label, "requests", [_outcomes(points[s]) if points[s] else "–" for s in servers])
    derived = data.get("derived", {})
    bits = (data.get("quantized") or {}).get("bits")
    for c, points in _by_concurrency(sc.get("quantized", {}), servers):
        label = f"quantized {bits}-bit C={c}, P={sizes.get('prompt_tokens')}, T={sizes.get('max_tokens')}"
        row(label, "output tok/s", [_fmt(points[s].get("output_tok_s")) for s in servers])
        row(label, "weights read per decode step, GB/s (÷ HBM bandwidth)",
            [_fmt((points[s].get("weight_bytes_per_s") or 0) / 1e9 or None)
             + (f" ({points[s]['weight_bandwidth_fraction']:.3f})"
                if points[s].get("weight_bandwidth_fraction") is not None else "") for s in servers])
    if "bandwidth_bound_tok_s" in derived:
        bw = (data.get("bandwidth") or {}).get("bytes_per_s", 0) / 1e9
        row(f"C=1 vs bandwidth bound ({bw:.0f} GB/s copy → {derived['bandwidth_bound_tok_s']:.0f} tok/s)",
            "fraction", [_fmt(derived.get(f"{s}_c1_bandwidth_fraction"), 3) for s in servers])
    guard = sc.get("guard", {}).get("ours")
    if guard and "error" not in guard:
        row(f"guard on vs off, C={guard['concurrency']}", "tok/s on / off (cost %, goal ≤ 2)",
            [f"{_fmt(guard['on_tok_s'])} / {_fmt(guard['off_tok_s'])} ({_fmt(guard['cost_pct'], 2)} %)"
             if s == "ours" else "n/a" for s in servers])
        if guard.get("admission_time_pct") is not None:
            row(f"guard, C={guard['concurrency']}", "engine time in admission checks, % of wall",
                [f"{_fmt(guard['admission_time_pct'], 3)} %" if s == "ours" else "n/a" for s in servers])
    def each(by_server: dict[str, Any], cell: Callable[[dict[str, Any]], str]) -> list[str]:
        """One cell per server: `cell` of its result, or a dash where it has none or failed."""
        return [cell(by_server[s]) if isinstance(by_server.get(s), dict) and "error" not in by_server[s]
                else "–" for s in servers]

    lengths = sorted({p["prompt_tokens"] for v in (sc.get("prefill") or {}).values() if isinstance(v, list)
                      for p in v if isinstance(p, dict) and p.get("prompt_tokens")})
    for n in lengths:
        points = {s: next((p for p in (sc["prefill"].get(s) or []) if isinstance(p, dict)
                           and p.get("prompt_tokens") == n), {}) for s in servers}
        peak = phys["flops"] / prefill_flops_per_token(phys) if phys else None  # prompt tokens/s
        row(f"prefill, one {n}-token prompt", "tok/s (÷ peak FLOP/s at 2 × params a token)",
            [_fmt(points[s].get("prefill_tok_s")) + _share(points[s].get("prefill_tok_s"), peak)
             for s in servers])
        row(f"prefill, one {n}-token prompt", "TTFT p50 ms (bound ms)",
            [_fmt(points[s].get("ttft_ms_p50"), 0) + (f" ({n / peak * 1e3:.0f})" if peak else "")
             for s in servers])
    if prefix := sc.get("prefix", {}):
        row(f"prefix cache, {sizes.get('prefix_tokens')}-token system prompt",
            "TTFT cold / hit ms (hit/cold, goal ≤ 0.1)",
            each(prefix, lambda v: _times(v, ("cold_ttft_ms_p50", "hit_ttft_ms_p50"), "hit_over_cold")))
    if agent := sc.get("agent", {}):
        row(f"agent conversation, {sizes.get('agent_turns')} turns of +{sizes.get('agent_turn_tokens')} "
            f"tokens on a {sizes.get('prefix_tokens')}-token system prompt",
            "turn 1 TTFT ms; later turns: most tokens prefilled, slowest TTFT ms",
            each(agent, lambda v: f"{_fmt(v['ttft_ms'][0], 0)}; {v.get('later_turns_prefilled_max')}, "
                                  f"{_fmt(v.get('later_turns_ttft_ms_max'), 0)}"))
    if disk := sc.get("prefix-disk", {}):
        row(f"prefix from disk after a restart, {sizes.get('prefix_tokens')}-token prompt",
            "TTFT cold / memory hit / disk hit ms (disk/cold)",
            each(disk, lambda v: _times(v, ("cold_ttft_ms", "memory_hit_ttft_ms", "disk_hit_ttft_ms"),
                                        "disk_over_cold")))
    if interference := sc.get("interference", {}):
        goals = next((v["goals"] for v in interference.values()
                      if isinstance(v, dict) and v.get("goals")), {})
        label = (f"interference, {sizes.get('interference_concurrency')} streams × "
                 f"{sizes.get('prompt_tokens')} tokens, one of {sizes.get('interference_long_tokens')}")
        row(label, f"streams' ITL p99 ms alone / beside the long prefill (goal ≤ {goals.get('itl_ms_p99')})",
            each(interference, lambda v: f"{_fmt((v.get('alone') or {}).get('itl_ms_p99'))} / "
                                         f"{_fmt(v.get('itl_ms_p99'))}"))
        row(label, f"late short request's TTFT ms (goal ≤ {goals.get('late_short_ttft_ms')})",
            each(interference, lambda v: _fmt(v.get("late_short_ttft_ms"), 0)))
        row(label, f"long prompt's TTFT / idle ms (ratio, goal ≤ {goals.get('long_ttft_over_idle')})",
            each(interference, lambda v: _times(v, ("long_ttft_ms", "long_idle_ttft_ms"),
                                                "long_ttft_over_idle")))
    pressure = sc.get("overload") or sc.get("pressure") or {}
    if pressure:
        ceiling = data.get("settings", {}).get("pressure_ceiling_bytes")
        label = (f"overload, {sizes.get('pressure_requests')} × {sizes.get('pressure_prompt_tokens')}"
                 f"-token prompts, T={sizes.get('pressure_max_tokens')}")
        if ceiling:
            label += f" (ours on a simulated {_fmt(ceiling)} machine)"
        cells = {s: pressure.get(s) or {} for s in servers}
        row(label, "200 / 507 / dropped", [f"{c.get('completed_200', '–')} / {c.get('refused_507', '–')} / "
                                           f"{c.get('dropped', '–')}" if "error" not in c else "error"
                                           for c in cells.values()])
        row(label, "peak memory", [_peak(c) for c in cells.values()])
        row(label, "/health failures; alive after", [
            f"{(c.get('watch') or {}).get('health_failures', '–')} of "
            f"{(c.get('watch') or {}).get('health_samples', '–')}; "
            f"{'yes' if (c.get('watch') or {}).get('alive_after') else 'no'}" for c in cells.values()])
    for error in data.get("errors", []):
        lines.append(f"\nerror: {error}")
    return "\n".join(lines)


def _by_concurrency(by_server: dict[str, Any], servers: list[str]) -> list[tuple[int, dict[str, Any]]]:
    """A load scenario's points, by concurrency: each server's point there, or {}."""
    lists = {s: [p for p in (by_server.get(s) or []) if isinstance(p, dict) and "concurrency" in p]
             if isinstance(by_server.get(s), list) else [] for s in servers}
    return [(c, {s: next((p for p in lists[s] if p["concurrency"] == c), {}) for s in servers})
            for c in sorted({p["concurrency"] for ps in lists.values() for p in ps})]


def _share(value: Any, bound: float | None) -> str:
    """" (0.431)": a figure's fraction of its bound, or nothing where either is missing."""
    return f" ({value / bound:.3f})" if isinstance(value, (int, float)) and bound else ""


def _times(result: dict[str, Any], keys: tuple[str, ...], ratio: str) -> str:
    """Times in ms, then a ratio: "700 / 28 (0.040)"."""
    return " / ".join(_fmt(result.get(k), 0) for k in keys) + f" ({_fmt(result.get(ratio), 3)})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for arg in argv:
        path = Path(arg)
        print(markdown(json.loads((path / "run.json" if path.is_dir() else path).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
