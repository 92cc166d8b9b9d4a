"""Load admission and `mlx-headroom doctor`, through real processes.

The machine is simulated with the allocator probe and a custom ceiling: the probe counts
MLX's own allocations, so a 25 MB ceiling is a 25 MB machine for the tiny models.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import forkserver
from tests.conftest import MODEL, ROOT, ServerProcess, free_port

TINY_DUMMY = ["--load-format", "dummy"]  # with --model tiny: the tiny preset, random weights


def simulated(ceiling_bytes: int) -> list[str]:
    return ["--memory-probe", "allocator", "--memory-tier", "custom",
            "--memory-ceiling-bytes", str(ceiling_bytes)]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`mlx-headroom <args>` in a process of its own (tests/forkserver.py: a fork where it can)."""
    return forkserver.run(list(args), cwd=ROOT, timeout=timeout)


def doctor(*args: str) -> tuple[int, dict[str, Any]]:
    """`doctor --json` in its own process: its allocator probe counts only its own arrays."""
    out = cli("doctor", "--json", *args)
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout)


def doctor_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The command's own function in this process, for what does not read the allocator."""
    from server.cli import main

    capsys.readouterr()
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def test_a_model_whose_reserve_exceeds_the_ceiling_is_refused_at_start_up(tmp_path: Path) -> None:
    out = cli("serve", "--model", "tiny", *TINY_DUMMY, *simulated(25_000_000),
              "--port", str(free_port()))
    assert out.returncode == 4, out.stderr
    err = out.stderr
    assert f"not loading {MODEL}: {MODEL} does not fit" in err  # the tiny preset's own name
    # the numbers: weights, the reserve's KV, the chunk, the total, and the binding ceiling
    assert "weights 2.5 MiB + KV for 8192 reserved tokens 16.0 MiB + one prefill chunk" in err
    assert "the custom ceiling 23.8 MiB" in err
    assert "--force-load loads it anyway" in err
    assert "building dummy model" not in out.stdout + err  # refused before any weights
    # what would fit does fit: the suggested reserve starts
    reserve = re.search(r"--reserve-context-tokens (\d+)", err)
    assert reserve is not None, err
    proc = ServerProcess(Path("tiny"), args=[*TINY_DUMMY, *simulated(25_000_000),
                                             "--reserve-context-tokens", reserve.group(1)])
    try:
        proc.start(tmp_path)
        model = httpx.get(proc.url + "/v1/memory").json()["model"]
        assert model["reserve_met"] is True
        assert model["reserve_context_tokens"] == int(reserve.group(1))
    finally:
        proc.stop()


def test_force_load_starts_and_says_the_reserve_is_not_met(tmp_path: Path) -> None:
    proc = ServerProcess(Path("tiny"), args=[*TINY_DUMMY, *simulated(25_000_000), "--force-load"])
    try:
        proc.start(tmp_path)
        log = proc.log()
        assert f"--force-load: loading although the reserve is not met: {MODEL} does not fit" in log
        memory = httpx.get(proc.url + "/v1/memory").json()
        model = memory["model"]
        assert (model["reserve_met"], model["forced"]) == (False, True)
        assert model["weight_bytes"] == 2_629_120  # the tiny preset in float32, fused or not
        assert model["fused_projection_groups"] == 8  # q/k/v and gate/up of its 4 layers
        assert model["reserve_context_tokens"] == 8192
        check = model["load_check"]
        assert check["required_bytes"] > memory["ceiling"]["hard_bytes"] == 25_000_000
        assert check["weight_bytes"] == model["weight_bytes"]  # predicted = loaded
        assert "does not fit" in check["message"]
        r = httpx.post(proc.url + "/v1/completions",
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text  # short requests still run under the guard
    finally:
        proc.stop()


def test_doctor_reports_this_machine_and_serve_agrees_on_its_ceiling(
    server: ServerProcess, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = doctor_here(capsys, "--json", "--model", str(tiny_model_path))
    report = json.loads(out)
    assert rc == 0 and report["ok"], report["problems"]
    assert report["backend"]["name"] == "cpu"
    assert all(p["ok"] for p in report["probes"].values())
    assert {"auto", "linux", "allocator"} <= set(report["probes"])
    ceiling = report["ceiling"]
    assert ceiling["hard_bytes"] == ceiling["components"][ceiling["binding"]] > 0
    served = httpx.get(server.url + "/v1/memory").json()
    # the static limit depends only on the machine: the server computes the same one
    assert ceiling["components"]["static"] == served["ceiling"]["components"]["static"]
    fit = report["model"]["fit"]
    assert report["model"]["weight_bytes"] == served["model"]["weight_bytes"]
    assert fit["fits"] and fit["max_prompt_tokens"] > 0
    assert [c["prompt_tokens"] for c in fit["concurrency"]] == [1024, 8192, 32768]
    assert fit["concurrency"][0]["requests"] > 0
    assert served["model"]["reserve_met"] is True and served["model"]["forced"] is False
    rc, text = doctor_here(capsys, "--model", str(tiny_model_path))
    assert rc == 0
    assert "longest prompt at concurrency 1" in text and "binds" in text


@pytest.mark.parametrize("budget", [[], ["--max-step-tokens", "2048"]], ids=["one-chunk", "four-chunks"])
def test_doctor_longest_prompt_is_what_admission_admits(
    tiny_model_path: Path, tmp_path: Path, budget: list[str]
) -> None:
    """The mirror holds whether a step runs one 512-token chunk or four (CUDA's default).
    Under this ceiling chunks are halved, and where a step's budget cuts them depends on
    the budget: with four chunks the engine admitted one token more than a one-chunk
    mirror computed."""
    flags = [*simulated(12_000_000), "--reserve-context-tokens", "256", *budget]
    rc, report = doctor("--model", str(tiny_model_path), "--max-tokens", "4", *flags)
    assert rc == 0, report
    longest = report["model"]["fit"]["max_prompt_tokens"]
    assert 500 < longest < 4000  # bound by the ceiling, not by the 8192-token context
    proc = ServerProcess(tiny_model_path, args=flags)
    try:
        proc.start(tmp_path)

        def complete(tokens: int, first: int) -> httpx.Response:
            prompt = [first] + [97] * (tokens - 1)  # distinct first tokens: no prefix hits
            return httpx.post(proc.url + "/v1/completions", timeout=120,
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 4})

        over = complete(longest + 1, 66)
        assert over.status_code == 507, over.text
        error = over.json()["error"]
        assert error["code"] in {"prefill_memory_exceeded", "prompt_exceeds_memory_ceiling"}
        assert "custom ceiling 11.4 MiB" in error["message"]
        fits = complete(longest, 65)
        assert fits.status_code == 200, fits.text
        assert fits.json()["usage"]["prompt_tokens"] == longest
    finally:
        proc.stop()


def test_doctor_fails_when_the_model_cannot_fit_at_all_or_a_probe_fails(
        tiny_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = doctor_here(capsys, "--json", "--model", str(tiny_model_path), *simulated(2_000_000))
    report = json.loads(out)
    assert rc == 1 and not report["ok"]
    assert report["model"]["fit"]["fits_at_all"] is False
    assert any("cannot fit at all" in p for p in report["problems"])
    rc, out = doctor_here(capsys, "--json", "--memory-probe", "macos")  # not a Mac: the probe fails
    report = json.loads(out)
    assert rc == 1
    assert report["probes"]["macos"]["ok"] is False
    assert any("probe 'macos' failed" in p for p in report["problems"])
