"""The engine's prefill steps, summarised from a server log at debug level.

With `--log-level debug` the engine logs each step that prefilled: the rows decoding, the
prompt tokens and chunks, the furthest context a chunk started at, and the prefill's and
the whole step's milliseconds. This groups those steps by context (`--bucket` tokens) and
prints per group: steps, median prompt tokens, median prefill ms, median and largest step
ms, and prompt tokens per second of step time. `python -m bench.step_log server.log`; the
bench itself keeps this summary of our server's log in run.json (`engine_steps`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

STEP = re.compile(r"step: (\d+) rows decoding, (\d+) prompt tokens in (\d+) chunks \(context up to (\d+)\), "
                  r"prefill ([\d.]+) ms, step ([\d.]+) ms")


def steps(lines: list[str]) -> list[dict[str, float]]:
    found = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            line = json.loads(line).get("message", "")
        m = STEP.search(line)
        if m:
            rows, tokens, chunks, context, prefill, step = m.groups()
            found.append({"rows": int(rows), "tokens": int(tokens), "chunks": int(chunks),
                          "context": int(context), "prefill_ms": float(prefill), "step_ms": float(step)})
    return found


def summary(found: list[dict[str, float]], bucket: int) -> list[dict[str, float]]:
    groups: dict[tuple[bool, int], list[dict[str, float]]] = defaultdict(list)
    for s in found:
        groups[(s["rows"] > 0, int(s["context"]) // bucket * bucket)].append(s)
    out = []
    for (decoding, start), group in sorted(groups.items()):
        step_s = sum(s["step_ms"] for s in group) / 1e3
        out.append({
            "decoding": decoding, "context_from": start, "steps": len(group),
            "tokens_p50": statistics.median(s["tokens"] for s in group),
            "prefill_ms_p50": round(statistics.median(s["prefill_ms"] for s in group), 1),
            "step_ms_p50": round(statistics.median(s["step_ms"] for s in group), 1),
            "step_ms_max": round(max(s["step_ms"] for s in group), 1),
            "prompt_tok_s": round(sum(s["tokens"] for s in group) / step_s) if step_s else 0,
        })
    return out


def from_logs(paths: list[Path], bucket: int = 10_000) -> list[dict[str, float]]:
    """The summary of every step line in these logs (empty when none was logged at debug)."""
    lines = [line for path in paths for line in path.read_text(errors="replace").splitlines()]
    return summary(steps(lines), bucket)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--bucket", type=int, default=10_000)
    args = p.parse_args(argv)
    for row in from_logs(args.logs, args.bucket):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
