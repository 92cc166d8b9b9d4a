"""A run as one PNG: `python -m bench plot bench/results/<folder> [-o docs/X.png]`.

Panels: output tokens/s and TTFT p50 against concurrency (both servers), guard on/off,
prefix cache cold vs hit TTFT, and the memory-pressure outcomes. Needs matplotlib (the
`bench` extra: `pip install -e '.[bench]'`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LABELS = {"ours": "mlx-headroom", "mlx_lm": "mlx_lm.server"}
COLORS = {"ours": "#1f77b4", "mlx_lm": "#ff7f0e"}


def plot(data: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sc = data.get("scenarios", {})
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    (ax_tp, ax_ttft, ax_tpot), (ax_guard, ax_prefix, ax_pressure) = axes
    model = data.get("model", {})
    machine = data.get("machine", {})
    device = (machine.get("device_info") or {}).get("device_name") or machine.get("cpu")
    fig.suptitle(f"{data.get('run')}: {model.get('name')} {model.get('dtype')} on {device} "
                 f"({machine.get('backend')})", fontsize=11)

    for server, points in (sc.get("throughput") or {}).items():
        if not isinstance(points, list):
            continue
        cs = [p["concurrency"] for p in points]
        kw = {"marker": "o", "label": LABELS.get(server, server), "color": COLORS.get(server)}
        ax_tp.plot(cs, [p.get("output_tok_s") or 0 for p in points], **kw)
        ax_ttft.plot(cs, [p.get("ttft_ms_p50") or 0 for p in points], **kw)
        ax_tpot.plot(cs, [p.get("tpot_ms_p50") or 0 for p in points], **kw)
    for ax, title in ((ax_tp, "output tokens/s"), (ax_ttft, "TTFT p50 (ms)"), (ax_tpot, "TPOT p50 (ms)")):
        ax.set_title(title)
        ax.set_xlabel("concurrent requests")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()

    guard = (sc.get("guard") or {}).get("ours") or {}
    if guard.get("on_tok_s"):
        ax_guard.bar(["guard on", "guard off"], [guard["on_tok_s"], guard["off_tok_s"]],
                     color=[COLORS["ours"], "#9ecae1"])
        ax_guard.set_title(f"guard cost at C={guard['concurrency']}: {guard['cost_pct']:.2f} % (goal ≤ 2)")
        ax_guard.set_ylabel("output tokens/s")
    else:
        ax_guard.set_title("guard on/off: not run")

    prefix = {s: v for s, v in (sc.get("prefix") or {}).items() if isinstance(v, dict) and "error" not in v}
    if prefix:
        names = list(prefix)
        x = range(len(names))
        ax_prefix.bar([i - 0.2 for i in x], [prefix[s]["cold_ttft_ms_p50"] for s in names], 0.4,
                      label="cold", color="#bbbbbb")
        ax_prefix.bar([i + 0.2 for i in x], [prefix[s]["hit_ttft_ms_p50"] for s in names], 0.4,
                      label="hit", color=[COLORS.get(s) for s in names])
        ax_prefix.set_xticks(list(x), [f"{LABELS.get(s, s)}\nhit/cold {prefix[s]['hit_over_cold']:.2f}"
                                       for s in names])
        tokens = next(iter(prefix.values()))["system_prompt_tokens"]
        ax_prefix.set_title(f"prefix cache: TTFT p50 (ms), {tokens}-token system prompt")
        ax_prefix.legend()
    else:
        ax_prefix.set_title("prefix cache: not run")

    pressure = {s: v for s, v in (sc.get("overload") or sc.get("pressure") or {}).items()
                if isinstance(v, dict) and "error" not in v}
    if pressure:
        names = list(pressure)
        ok = [pressure[s]["completed_200"] for s in names]
        refused = [pressure[s]["refused_507"] for s in names]
        other_failed = [pressure[s]["failed"] - pressure[s]["refused_507"] for s in names]
        dropped = [pressure[s]["dropped"] for s in names]
        labels = [f"{LABELS.get(s, s)}\n{'alive' if pressure[s]['watch']['alive_after'] else 'DIED'}, "
                  f"/health fails {pressure[s]['watch']['health_failures']}" for s in names]
        bottom = [0] * len(names)
        stacks = ((ok, "200", "#2ca02c"), (refused, "507", "#ffbf00"),
                  (other_failed, "other error", "#d62728"), (dropped, "dropped", "#7f7f7f"))
        for values, label, color in stacks:
            ax_pressure.bar(labels, values, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        first = next(iter(pressure.values()))
        ax_pressure.set_title(
            f"overload: {first['requests']} × {first['prompt_tokens']}-token prompts")
        ax_pressure.legend()
    else:
        ax_pressure.set_title("overload: not run")

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench plot", description="plot a run")
    parser.add_argument("results", type=Path, help="a results folder (its run.json) or a results JSON")
    parser.add_argument("-o", "--out", type=Path, help="default: plot.png in the results folder")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    path = args.results / "run.json" if args.results.is_dir() else args.results
    data = json.loads(path.read_text())
    print(plot(data, args.out or path.parent / "plot.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
