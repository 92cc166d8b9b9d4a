"""summary.json, the one format every run writes: its rows' keys and types, from a run the bench
makes on the tiny model, from recorded run data, and from the files earlier benches wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import summary
from bench.machine import machine_slug, result_dir

POINT = {"concurrency": 4, "stream": True, "run": "cold", "requests": 4, "ok": 4, "failed": 0, "dropped": 0,
         "output_tok_s": 120.5, "ttft_ms_p50": 80.0, "tpot_ms_p50": 9.0, "itl_ms_p99": 14.0,
         "engine": {"prefill_tok_s": 5000.0}}
RUN: dict[str, Any] = {
    "run": "x", "command": "python -m bench throughput prefix", "commit": "abc1234",
    "started_at": "2026-12-03T09:28:29",
    "machine": {"backend": "cuda", "device_info": {"device_name": "NVIDIA H200"}},
    "versions": {"mlx_headroom": "0.1.0+abc1234", "source_digest": "0123456789ab"},
    "model": {"name": "llama3-8b", "dtype": "bfloat16"},
    "settings": {"sizes": {"prompt_tokens": 1000, "max_tokens": 256}},
    "bound": {"prompt_tokens": 1000, "max_tokens": 256, "best_prefill_tok_s": 44000.0,
              "decode_step_ms": {"4": 6.0}},
    "scenarios": {
        "warmup": {"ours": {"c1": {}}},
        "throughput": {"ours": [POINT], "mlx_lm": [POINT | {"output_tok_s": 60}]},
        "prefix": {"ours": {"system_prompt_tokens": 2048, "suffix_tokens": 32, "cold_ttft_ms_p50": 400.0,
                            "hit_ttft_ms_p50": 40.0, "hit_over_cold": 0.1}},
        "prefill": {"mlx_lm": [POINT | {"concurrency": 1, "prompt_tokens": 512, "prefill_tok_s": 9000.0}]},
        "interference": {"ours": POINT | {"prompt_tokens": 128, "long_prompt_tokens": 2048,
                                          "long_ttft_ms": 900.0, "alone": {"itl_ms_p99": 10.0}}},
        "overload": {"ours": POINT | {"requests": 40, "prompt_tokens": 32768, "completed_200": 40,
                                      "refused_507": 0, "watch": {"alive_after": True, "peak": {}}}},
        "guard": {"ours": {"concurrency": 32, "prompt_tokens": 1000, "on_tok_s": 2000.0, "off_tok_s": 2010.0,
                           "cost_pct": 0.5, "runs": {"on": [{"failed": 0}], "off": [{"failed": 1}]}}},
        "quantized": {"ours": {"error": "RuntimeError: boom"}},
    },
}


def test_a_run_s_summary_has_one_valid_row_per_point() -> None:
    s = summary.from_run(RUN)
    assert summary.validate(s) == []
    assert (s["machine"], s["commit"], s["date"], s["command"]) == ("h200", "abc1234", "2026-12-03",
                                                                    RUN["command"])
    by = {(r["server"], r["scenario"]): r for r in s["rows"]}
    assert set(by) == {("ours", "throughput"), ("mlx_lm", "throughput"), ("bare", "throughput"),
                       ("ours", "prefix"), ("mlx_lm", "prefill"), ("ours", "interference"),
                       ("ours", "overload"), ("ours", "guard")}  # no warm-up row, no row for an error
    ours = by["ours", "throughput"]
    shape = (ours["model"], ours["dtype"], ours["concurrency"], ours["prompt_tokens"])
    assert shape == ("llama3-8b", "bf16", 4, 1000)
    assert ours["ttft_p50_s"] == 0.08 and ours["itl_p99_ms"] == 14.0 and ours["prefill_tok_s"] == 5000.0
    bare = by["bare", "throughput"]
    assert bare["output_tok_s"] == bare["bound_tok_s"] > 0 and bare["failed"] == 0
    assert by["ours", "prefix"]["hit_over_cold"] == 0.1
    assert by["mlx_lm", "prefill"]["prefill_tok_s"] == 9000.0
    assert by["ours", "interference"]["itl_p99_ms_alone"] == 10.0
    assert by["ours", "guard"]["failed"] == 1
    assert json.loads(json.dumps(s)) == s


def test_validate_names_what_is_wrong() -> None:
    good = summary.from_run(RUN)
    row = dict(good["rows"][0])
    del row["failed"]
    bad = {"machine": "h200", "rows": [row, good["rows"][1] | {"server": "vllm", "concurrency": "4"}]}
    problems = summary.validate(bad)
    assert "missing 'commit'" in problems and "row 0: missing 'failed'" in problems
    assert any("server 'vllm'" in p for p in problems) and any("concurrency='4'" in p for p in problems)


def test_older_results_files_convert() -> None:
    old = {k: v for k, v in RUN.items() if k not in ("command", "commit", "started_at", "bound")}
    old |= {"run": "gpu-20261203-092829-goals", "argv": ["--mode", "gpu"],
            "scenarios": {"pressure": RUN["scenarios"]["overload"]}}
    s = summary.convert(old)
    assert summary.validate(s) == []
    header = (s["date"], s["commit"], s["command"])
    assert header == ("2026-12-03", "abc1234", "python -m bench.run --mode gpu")
    assert [r["scenario"] for r in s["rows"]] == ["overload"]
    agreement = {"mode": "gpu", "model": "llama3-8b", "dtype": "bfloat16", "goals": {},
                 "argv": ["--phases", "long"],
                 "phases": {"long": {"load": POINT | {"requests": 40}, "memory": {"peak_driver_bytes": 1}}}}
    s = summary.convert(agreement, machine="h200", commit="a9aec5a")
    assert summary.validate(s) == [] and s["rows"][0]["concurrency"] == 40
    assert s["rows"][0]["prompt_tokens"] == 32768 and s["rows"][0]["peak_driver_bytes"] == 1


def test_results_folders_are_named_by_date_machine_and_scenario(tmp_path: Path) -> None:
    h200 = {"backend": "cuda", "device_info": {"device_name": "NVIDIA H200"}}
    assert machine_slug(h200) == "h200" and machine_slug({"backend": "cpu"}) == "cpu"
    first = result_dir(tmp_path, h200, "throughput", "2026-12-03")
    assert first.name == "2026-12-03-h200-throughput"
    first.mkdir()
    assert result_dir(tmp_path, h200, "throughput", "2026-12-03").name == "2026-12-03-h200-throughput-2"


RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_every_committed_results_folder_has_a_valid_summary() -> None:
    """Each folder under bench/results is `<date>-<machine>-<scenario>` and holds a summary.json
    that validates, with its command and the commit it ran on (or, where the run did not
    record it, the commit that added the files)."""
    folders = sorted(d for d in RESULTS.iterdir() if d.is_dir())
    assert folders
    for d in folders:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9]+-[a-z0-9.-]+", d.name), d.name
        data = json.loads((d / "summary.json").read_text())
        assert summary.validate(data) == [], d.name
        assert d.name[len("YYYY-MM-DD-"):].startswith(data["machine"] + "-"), d.name  # h200, apple-m2-max
        assert data.get("commit") or data.get("added_in"), d.name
        assert data.get("command"), d.name


def test_the_bench_writes_a_valid_summary_from_a_tiny_cpu_run(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench", "throughput", "prefill", "--mode", "cpu", "--servers", "ours",
           "--no-bound", "--bandwidth-bytes", "0", "--concurrency", "1", "--prompt-tokens", "32",
           "--max-tokens", "4", "--prefill-lengths", "48", "--prefill-repeats", "1",
           "--out-dir", str(tmp_path), "--ours-arg=--log-level", "--ours-arg=debug"]
    env = {**os.environ, "MLX_HEADROOM_CACHE": str(tmp_path / "cache")}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (folder,) = [p for p in tmp_path.iterdir() if p.name.endswith("-cpu-throughput-prefill")]
    s = json.loads((folder / "summary.json").read_text())
    assert summary.validate(s) == []
    assert s["command"].startswith("python -m bench throughput prefill --mode cpu")
    rows = {(r["scenario"], r["concurrency"], r["prompt_tokens"]): r for r in s["rows"]}
    assert set(rows) == {("throughput", 1, 32), ("prefill", 1, 48)}
    assert all(r["server"] == "ours" and r["model"] == "tiny" and r["dtype"] == "fp32" and r["failed"] == 0
               for r in rows.values())
    assert rows["throughput", 1, 32]["output_tok_s"] > 0 and rows["prefill", 1, 48]["prefill_tok_s"] > 0
    steps = json.loads((folder / "run.json").read_text())["engine_steps"]  # the server logged at debug
    assert steps and sum(r["steps"] for r in steps) >= 2


def test_the_agent_scenarios_report_reuse_per_turn_and_from_disk_after_a_restart(tmp_path: Path) -> None:
    """`agent`: every turn after the first prefills only its growth (the last prompt and its
    answer come from the prefix cache); `prefix-disk`: after a restart with the same
    --prefix-cache-dir the prompt's blocks are read back from disk, not prefilled."""
    cmd = [sys.executable, "-m", "bench", "agent", "prefix-disk", "--mode", "cpu", "--servers", "ours",
           "--no-bound", "--bandwidth-bytes", "0", "--prefix-tokens", "1024", "--agent-turns", "3",
           "--agent-turn-tokens", "200", "--agent-answer-tokens", "8", "--out-dir", str(tmp_path)]
    env = {**os.environ, "MLX_HEADROOM_CACHE": str(tmp_path / "cache")}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (folder,) = [p for p in tmp_path.iterdir() if p.name.endswith("-cpu-agent-prefix-disk")]
    assert summary.validate(json.loads((folder / "summary.json").read_text())) == []
    results = json.loads((folder / "run.json").read_text())["scenarios"]
    agent, disk = results["agent"]["ours"], results["prefix-disk"]["ours"]
    assert agent["turns"] == 3 and agent["cached_tokens"][0] == 0
    for n in (1, 2):  # everything the previous turn sent is reused
        assert agent["cached_tokens"][n] >= agent["prompt_tokens"][n - 1]
        assert agent["prefilled_tokens"][n] < agent["prompt_tokens"][n] - 1024
    assert disk["memory_cached_tokens"] > 1024 and disk["disk_cached_tokens"] > 1024
    assert disk["prefix_cache_after_restart"]["disk"]["hits"] > 0
