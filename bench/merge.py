"""Merge results files of one benchmark split across several runs (e.g. one device call per
scenario group) into one: `python -m bench.merge OUT.json A.json B.json ...`.

The header (machine, versions, model, bandwidth, settings) comes from the first file that has
it; scenarios are merged per server, later files winning; errors are concatenated; each part's
run name is kept under `parts`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.run import derived


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"scenarios": {}, "errors": [], "parts": []}
    for part in parts:
        for key, value in part.items():
            if key in ("scenarios", "errors"):
                continue
            if out.get(key) in (None, {}, []):
                out[key] = value
        for scenario, by_server in part.get("scenarios", {}).items():
            out["scenarios"].setdefault(scenario, {}).update(by_server)
        out["errors"] += part.get("errors", [])
        out["parts"].append({"run": part.get("run"), "argv": part.get("argv"),
                             "scenarios": sorted(part.get("scenarios", {}))})
    out["run"] = f"{out.get('run')}+{len(parts) - 1}" if len(parts) > 1 else out.get("run")
    out["derived"] = derived(out)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit("usage: python -m bench.merge OUT.json IN.json [IN.json ...]")
    merged = merge([json.loads(Path(p).read_text()) for p in argv[1:]])
    Path(argv[0]).write_text(json.dumps(merged, indent=1))
    print(argv[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
