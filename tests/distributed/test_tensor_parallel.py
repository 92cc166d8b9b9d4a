"""`serve --tensor-parallel 2` on the CPU: two ranks over MLX's ring backend on 127.0.0.1,
started by `mlx.launch`, the tiny float32 model split in two.

- The split model answers as the whole one: the same greedy tokens for 32 steps, and
  logprobs within float32 tolerance (the all_sums add the halves in another order).
- Admission is the group's: with only rank 1 made to look full (a per-rank probe injection),
  rank 0, which has room, still refuses with 507 (every rank refused: had one admitted,
  the ranks' digests would differ and the group would fail), and the next request runs.
- A rank that dies, or hangs, fails the group cleanly: the in-flight request gets a 503 that
  says so, and the whole group exits non-zero, within a bound.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL, ServerProcess, free_port_run, wait_until

pytestmark = pytest.mark.slow  # several processes per test

MiB = 1 << 20
PROMPT = "The quick brown fox"


def tp_server(model: Path, tmp_path: Path, *, env: dict[str, str] | None = None,
              args: list[str] | None = None) -> ServerProcess:
    args = ["--tensor-parallel", "2", "--tp-port", str(free_port_run()), *(args or [])]
    return ServerProcess(model, env=env or {}, args=args).start(tmp_path, timeout=120)


def complete(url: str, max_tokens: int, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def rank_pids(wrapper: ServerProcess) -> dict[int, int]:
    """The rank processes of this group: MLX_RANK in their environment, our port in argv."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(wrapper.port).encode() not in argv or b"server.cli" not in argv:
            continue
        for item in environ:
            if item.startswith(b"MLX_RANK="):
                found[int(item.split(b"=", 1)[1])] = int(entry.name)
    return found


def test_split_model_answers_as_the_whole_one(server: ServerProcess, tiny_model_path: Path,
                                              tmp_path: Path) -> None:
    tp = tp_server(tiny_model_path, tmp_path)
    try:
        whole = complete(server.url, 32, logprobs=1).json()["choices"][0]
        split = complete(tp.url, 32, logprobs=1).json()["choices"][0]
        assert split["logprobs"]["tokens"] == whole["logprobs"]["tokens"]
        assert len(split["logprobs"]["tokens"]) == 32 and split["finish_reason"] == "length"
        assert split["text"] == whole["text"]
        assert split["logprobs"]["token_logprobs"] == pytest.approx(
            whole["logprobs"]["token_logprobs"], abs=1e-4)
        memory = httpx.get(tp.url + "/v1/memory", timeout=10).json()["tensor_parallel"]
        assert memory["size"] == 2 and [r["rank"] for r in memory["ranks"]] == [0, 1]
        assert all(r["usage_bytes"] > 0 and r["ceiling_bytes"] > 0 for r in memory["ranks"])
        # Idle, the group sleeps. The launcher only relays the ranks' output (its relay loop
        # once spun on the ranks' always-writable stdin pipes: 1.2 CPU-seconds a second), and
        # rank 1 waits between steps as rank 0 does (stepping back to back, it spun inside
        # the ring's all_gather until rank 0's next idle row: 1.0 CPU-second a second).
        ranks = rank_pids(tp)
        idle = [launcher_process(tp), ranks[0], ranks[1]]
        used = [cpu_seconds(pid) for pid in idle]
        time.sleep(1.0)  # a window to measure the idle processes' CPU over, not a wait
        cpu = [cpu_seconds(pid) - u for pid, u in zip(idle, used, strict=True)]
        assert cpu[0] < 0.2 and cpu[1] < 0.3 and cpu[2] < 0.3, cpu  # launcher, rank 0, rank 1
        assert complete(tp.url, 4).json()["choices"][0]["text"]  # and wakes for the next request
    finally:
        assert tp.stop() == 0, tp.log()  # rank 0 drained and told rank 1 to stop


def launcher_process(wrapper: ServerProcess) -> int:
    """The `mlx.launch` process that `serve --tensor-parallel` started."""
    assert wrapper.proc is not None
    children = Path(f"/proc/{wrapper.proc.pid}/task/{wrapper.proc.pid}/children").read_text().split()
    launchers = [int(pid) for pid in children
                 if b"mlx._distributed_utils.launch" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(launchers) == 1, children
    return launchers[0]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU of a process so far (/proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_one_full_rank_refuses_for_all(tiny_model_path: Path, tmp_path: Path) -> None:
    # Rank 1 looks 24 MiB fuller; the ceiling is 32 MiB. A request that reserves ~8 MiB of
    # KV fits rank 0 (under 10 MiB in use) but not rank 1; a small one fits both.
    tp = tp_server(tiny_model_path, tmp_path,
                   env={"MLX_HEADROOM_TP_EXTRA_BYTES": f"1={24 * MiB}"},
                   args=["--memory-probe", "allocator", "--memory-tier", "custom",
                         "--memory-ceiling-bytes", str(32 * MiB)])
    try:
        memory = httpx.get(tp.url + "/v1/memory", timeout=10).json()["tensor_parallel"]
        rank0, rank1 = memory["ranks"]
        assert memory["binding_rank"] == 1
        assert rank0["headroom_bytes"] > 16 * MiB > rank1["headroom_bytes"]
        refused = complete(tp.url, 8000)
        assert refused.status_code == 507, refused.text
        assert "rank 1 of 2 has the least room" in refused.json()["error"]["message"]
        served = complete(tp.url, 8)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 8
    finally:
        assert tp.stop() == 0, tp.log()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
def test_a_dead_rank_fails_the_group_cleanly(how: signal.Signals, tiny_model_path: Path,
                                             tmp_path: Path) -> None:
    # A dead rank breaks the ring at once; a hung one (stopped) only the watchdog sees, and
    # mlx.launch would wait on it forever when it terminates the group: `serve` kills it.
    tp = tp_server(tiny_model_path, tmp_path, args=["--tp-timeout-s", "3"])
    try:
        assert tp.proc is not None
        answer: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: answer.append(complete(tp.url, 4000)), daemon=True)
        worker.start()
        wait_until(lambda: httpx.get(tp.url + "/v1/memory", timeout=5).json()["queue"]["running"] == 1,
                   timeout=30)
        ranks = rank_pids(tp)
        assert sorted(ranks) == [0, 1]
        killed_at = time.monotonic()
        os.kill(ranks[1], how)
        worker.join(timeout=30)
        assert answer, "the in-flight request was not answered"
        assert answer[0].status_code == 503, answer[0].text
        error = answer[0].json()["error"]
        assert error["code"] == "engine_unavailable"
        assert "tensor-parallel group failed" in error["message"]
        with contextlib.suppress(httpx.TransportError):  # until the process is gone, /health says so
            assert httpx.get(tp.url + "/health", timeout=2).status_code == 503
        tp.proc.wait(timeout=30)
        assert tp.proc.returncode != 0
        assert time.monotonic() - killed_at < 30
        wait_until(lambda: not rank_pids(tp), timeout=10)  # rank 0 gone too, nothing left behind
    finally:  # a failing run must not leave ranks behind (a stopped one least of all)
        for pid in rank_pids(tp).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if tp.proc is not None and tp.proc.poll() is None:
            tp.proc.kill()
