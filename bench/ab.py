"""Interleaved, repeated A/B of one benchmark command across configurations.

    python -m bench.ab --runs 3 --field ms --field queue_ms \\
        --config default= --config ops200=MLX_MAX_OPS_PER_BUFFER=200 \\
        -- python3 -m bench.engine_step --model llama3-8b --dtype bfloat16 --split-only --batch 32

On the H200 the same configuration stepped in 9.5 ms in one process and 14.5 ms in the next
(docs/throughput.md, session 4). So one run per configuration decides nothing. This runs
the command once per configuration per round, A B A B ..., each in a fresh process, with
the configuration's environment added. It reads the last JSON object each run prints, and
reports each field's median, min and max per configuration, plus every value in order.

A configuration is `NAME=` (no change) or `NAME=VAR=VALUE[,VAR=VALUE...]`. `--arg
NAME=--flag` appends an argument to that configuration's command (repeatable).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Config:
    name: str
    env: dict[str, str]
    args: list[str] = field(default_factory=list)


def parse_config(spec: str) -> Config:
    name, _, rest = spec.partition("=")
    if not name:
        raise ValueError(f"--config needs NAME=...: {spec!r}")
    env = {}
    for item in filter(None, rest.split(",")):
        var, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config {name}: {item!r} is not VAR=VALUE")
        env[var] = value
    return Config(name, env)


def last_json(stdout: str) -> dict[str, Any] | None:
    """The JSON object that ends the output: one line (`bench.engine_step`) or indented
    over many (`bench.http_cost`)."""
    starts = [i for i, ch in enumerate(stdout) if ch == "{" and (i == 0 or stdout[i - 1] == "\n")]
    for start in reversed(starts):
        try:
            value = json.loads(stdout[start:])
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def run(configs: list[Config], command: list[str], runs: int, fields: list[str],
        timeout_s: float | None = None) -> dict[str, Any]:
    values: dict[str, dict[str, list[float]]] = {c.name: {f: [] for f in fields} for c in configs}
    failures: dict[str, list[str]] = {c.name: [] for c in configs}
    outputs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
    for _ in range(runs):
        for c in configs:
            proc = subprocess.run([*command, *c.args], env={**os.environ, **c.env}, capture_output=True,
                                  text=True, timeout=timeout_s, check=False)
            out = last_json(proc.stdout) if proc.returncode == 0 else None
            if out is None:
                failures[c.name].append(f"rc={proc.returncode}: {proc.stderr.strip()[-200:]}")
                continue
            outputs[c.name].append(out)
            for f in fields:
                if isinstance(out.get(f), int | float):
                    values[c.name][f].append(float(out[f]))
    report: dict[str, Any] = {"runs": runs, "command": command, "configs": {}}
    for c in configs:
        per_field = {}
        for f, vs in values[c.name].items():
            per_field[f] = {"median": round(statistics.median(vs), 3), "min": min(vs), "max": max(vs),
                            "values": vs} if vs else None
        report["configs"][c.name] = {"env": c.env, "args": c.args, "fields": per_field,
                                     "failures": failures[c.name], "outputs": outputs[c.name]}
    return report


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m bench.ab [options] -- COMMAND ...")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, help="NAME= or NAME=VAR=VALUE[,...]")
    p.add_argument("--arg", action="append", default=[], help="NAME=ARG: an extra argument for NAME")
    p.add_argument("--field", action="append", required=True, help="a numeric field of the JSON output")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout-s", type=float)
    a = p.parse_args(argv[:split])
    configs = [parse_config(spec) for spec in a.config]
    by_name = {c.name: c for c in configs}
    for spec in a.arg:
        name, _, arg = spec.partition("=")
        if name not in by_name:
            raise SystemExit(f"--arg {spec!r}: no configuration named {name!r}")
        by_name[name].args.append(arg)
    print(json.dumps(run(configs, argv[split + 1:], a.runs, a.field, a.timeout_s)))


if __name__ == "__main__":
    main()
