"""Where our server's threads spend a load: py-spy samples every thread's Python stack
(idle frames included) while `bench.loadgen` drives the dummy 8B model closed-loop.

    python -m bench.pyspy_server --out-dir $OUT -c 32 --seconds 20

Writes OUT/pyspy-cC.txt (py-spy's raw collapsed stacks: one line per stack, thread first,
then its sample count), the load's summary as OUT/pyspy-load-cC.json, and the server's log.
Needs `py-spy` on PATH (staged with the device wheels, docs/throughput.md). Sampling starts
`--after` seconds into the load, past the first wave's prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
from pathlib import Path

from bench.loadgen import Workload, run_load
from bench.servers import Server


async def _profile(server: Server, workload: Workload, out: Path, after: float, seconds: int) -> dict:
    load = asyncio.create_task(run_load(server.url, workload))
    await asyncio.sleep(after)  # a profile window, not synchronisation: the load runs on regardless
    assert server.proc is not None
    spy = await asyncio.create_subprocess_exec(
        "py-spy", "record", "--pid", str(server.proc.pid), "--duration", str(seconds), "--rate", "250",
        "--format", "raw", "--threads", "--idle", "--nonblocking",
        "-o", str(out / f"pyspy-c{workload.concurrency}.txt"))
    await spy.wait()
    return (await load).summary()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("-c", "--concurrency", type=int, default=32)
    p.add_argument("-p", "--prompt-tokens", type=int, default=1000)
    p.add_argument("-t", "--max-tokens", type=int, default=256)
    p.add_argument("--waves", type=int, default=6, help="requests = waves × concurrency")
    p.add_argument("--seconds", type=int, default=20)
    p.add_argument("--after", type=float, default=5.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the server")
    a = p.parse_args()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    server = Server("ours", ["server.cli", "serve", "--load-format", "dummy", "--model", a.model,
                             "--dtype", a.dtype, "--served-model-name", "bench", "--log-level", "warning",
                             *a.server_arg], a.out_dir).start()
    try:
        workload = Workload(a.concurrency, a.prompt_tokens, a.max_tokens, a.waves * a.concurrency,
                            model="bench")
        summary = asyncio.run(_profile(server, workload, a.out_dir, a.after, a.seconds))
    finally:
        server.stop()
    (a.out_dir / f"pyspy-load-c{a.concurrency}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    subprocess.run(["py-spy", "--version"], check=True)  # fail before the model loads, not after
    main()
