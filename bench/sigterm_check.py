"""SIGTERM with requests in flight: does the server drain them and exit 0?

Starts `mlx-headroom serve`, sends `--concurrency` streaming requests, sends SIGTERM once
every one of them has produced tokens, and reports the exit status, how each request
ended, and whether the log shows an abort ("terminate called", a Traceback) or the
engine's teardown. Exit status 0 when the server exited 0 and every request finished.

    # here, on the CPU, with the embedded tiny model (about 15 s)
    python bench/sigterm_check.py
    # on the H200 (after the device README's two install calls)
    python3 bench/sigterm_check.py --model llama3-8b --load-format dummy \
        --concurrency 8 --max-tokens 256 --repeat 3 --out $OUT/sigterm.json

On CUDA before the fix the process printed "Finished server process", then "terminate
called without an active exception", and exited 134. PYTHONFAULTHANDLER is set, so an
abort leaves the threads' stacks in the log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", args.model, "--port", str(port),
           "--max-concurrency", str(max(args.concurrency, 1))]
    if args.load_format:
        cmd += ["--load-format", args.load_format]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "MLX_HEADROOM_LOG_LEVEL": "info",
           "MLX_HEADROOM_SHUTDOWN_GRACE_S": str(args.grace_s)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_path.open("wb"),
                            stderr=subprocess.STDOUT)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during startup with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy in time")


async def _stream(client: httpx.AsyncClient, model: str, max_tokens: int,
                  progress: dict[int, int], index: int) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True}
    finish, tokens, error = None, 0, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "error": (await r.aread()).decode()[:300]}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                choice = chunk["choices"][0]
                if choice.get("text"):
                    tokens += 1
                    progress[index] = tokens
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"status": 200, "finish_reason": finish, "chunks": tokens, "error": error}


async def _run(url: str, proc: subprocess.Popen[bytes], args: argparse.Namespace) -> dict[str, Any]:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    progress: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10)) as client:
        tasks = [asyncio.create_task(_stream(client, model, args.max_tokens, progress, i))
                 for i in range(args.concurrency)]
        deadline = time.monotonic() + args.first_token_timeout_s
        while len(progress) < args.concurrency and time.monotonic() < deadline:
            if all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)  # polling the streams' progress, not synchronising
        in_flight = sum(1 for t in tasks if not t.done())
        signalled_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks)
    rc = await asyncio.to_thread(proc.wait, args.exit_timeout_s)
    return {"in_flight_at_sigterm": in_flight, "streams_with_tokens_at_sigterm": len(progress),
            "requests": results, "exit_code": rc,
            "exit_s_after_sigterm": round(time.monotonic() - signalled_at, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--grace-s", type=float, default=120.0)
    parser.add_argument("--startup-timeout-s", type=float, default=420.0)
    parser.add_argument("--first-token-timeout-s", type=float, default=120.0)
    parser.add_argument("--exit-timeout-s", type=float, default=180.0)
    parser.add_argument("--out", type=Path, help="write the report here as JSON (the logs beside it)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="start, load, SIGTERM this many times (the abort was intermittent)")
    args = parser.parse_args()

    log_dir = args.out.parent if args.out else Path(tempfile.mkdtemp(prefix="sigterm-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    reports = [_once(args, log_dir / f"sigterm-server-{i}.log") for i in range(1, args.repeat + 1)]
    summary = {
        "ok": all(r["ok"] for r in reports),
        "runs": len(reports),
        "exit_codes": [r["exit_code"] for r in reports],
        "aborted": sum(1 for r in reports if r["log_terminate_called"]),
        "runs_detail": reports,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if summary["ok"] else 1


def _once(args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(args, port, log_path)
    try:
        _wait_healthy(proc, url, args.startup_timeout_s)
        report = asyncio.run(_run(url, proc, args))
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        print(log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    log = log_path.read_text(errors="replace")
    report.update({
        "model": args.model, "load_format": args.load_format, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "log": str(log_path),
        "log_terminate_called": "terminate called" in log,
        "log_traceback": "Traceback" in log,
        "log_engine_released": "engine thread ended; MLX state released" in log,
    })
    # A random-weight model may sample its end-of-sequence token: "stop" is a finish too.
    finished = all(r.get("finish_reason") in ("length", "stop") and not r.get("error")
                   for r in report["requests"])
    report["all_requests_finished"] = finished
    report["ok"] = report["exit_code"] == 0 and finished and report["in_flight_at_sigterm"] > 0
    if not report["ok"]:
        print(log[-4000:], file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(main())
