"""The benchmark harness: our server and mlx_lm.server on the same dummy model, in one run.

    python -m bench.run --mode cpu-quick                 # tiny float32 model, ~3 minutes here
    python -m bench.run --mode gpu --out-dir $OUT        # llama3-8b bf16 on the H200
    python -m bench.run --mode gpu --scenarios throughput,guard --servers ours

Ours runs `--load-format dummy`; mlx_lm.server loads the same weights from a directory that
`engine.dummy_model.save_dummy_model` writes (cached between runs). Scenarios (`--scenarios`):
throughput (both), guard (ours: guard on vs off), prefix (both: cached long system prompt vs
cold), pressure (both: N concurrent long prompts whose KV exceeds memory; for ours on a CPU the
small machine is simulated with `--memory-probe allocator --memory-tier custom
--memory-ceiling-bytes N`). The results JSON (`bench/results/<mode>-<time>.json`, or under
`--out-dir`) is rewritten as each scenario finishes, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from bench import scenarios
from bench.scenarios import Sizes
from bench.servers import ROOT, Server, stop_all
from server.malloc import early_choice, reexec_env

SCENARIOS = ("throughput", "guard", "prefix", "pressure")
SERVERS = ("ours", "mlx_lm")
API_KEY = "bench-key"
OURS_NAME = "bench"  # --served-model-name
MLX_LM_NAME = "default_model"  # mlx_lm.server's name for its --model


@dataclasses.dataclass(frozen=True)
class Mode:
    model: str
    dtype: str
    sizes: Sizes
    bandwidth_bytes: int
    pressure_fit: int | None  # simulate a machine where this many pressure prompts fit (ours)
    startup_timeout_s: float


MODES: dict[str, Mode] = {
    "cpu-quick": Mode(
        model="tiny", dtype="float32", bandwidth_bytes=256 << 20, pressure_fit=3, startup_timeout_s=120,
        sizes=Sizes(concurrency=(1, 8, 32), prompt_tokens=128, max_tokens=32, guard_concurrency=8,
                    guard_rounds=2, guard_waves=3,
                    prefix_tokens=2048, pressure_requests=12, pressure_prompt_tokens=2048,
                    pressure_max_tokens=8, pressure_timeout_s=120, pressure_deadline_s=90,
                    request_timeout_s=120),
    ),
    "gpu": Mode(
        model="llama3-8b", dtype="bfloat16", bandwidth_bytes=4 << 30, pressure_fit=None,
        startup_timeout_s=420,
        sizes=Sizes(concurrency=(1, 8, 32), prompt_tokens=1000, max_tokens=256, guard_concurrency=32,
                    prefix_tokens=8000, prefix_suffix_tokens=64, pressure_requests=40,
                    pressure_prompt_tokens=32768, pressure_max_tokens=16, pressure_timeout_s=900,
                    pressure_deadline_s=240, request_timeout_s=600),
    ),
}


def openblas_preload() -> str | None:
    """LD_PRELOAD value for Debian's OpenBLAS (float32 matmuls ~30× the bundled BLAS on a CPU)."""
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        if Path(d, "libopenblas.so.0").exists():
            return "libopenblas.so.0"
    return None


def simulated_ceiling(info: dict[str, Any], sizes: Sizes, fit: int) -> int:
    """A memory ceiling under which about `fit` pressure prompts fit at once: the weights, the
    allocator's cache, one prefill chunk's transients, and `fit` decode reservations."""
    from memory.estimate import estimate_decode_reservation, estimate_prefill, geometry_from_config

    config = info["model"]["config"]
    geometry = geometry_from_config(config, dtype_bytes=4 if config["torch_dtype"] == "float32" else 2)
    chunk = 512
    transient = estimate_prefill(geometry, chunk_tokens=chunk, backend="cpu",
                                 context_tokens=max(sizes.pressure_prompt_tokens - chunk, 0)).total_bytes
    reservation = estimate_decode_reservation(geometry, prompt_tokens=sizes.pressure_prompt_tokens,
                                              max_tokens=sizes.pressure_max_tokens)
    return int(info["model"]["weight_bytes"]) + (32 << 20) + transient + fit * reservation


def _machine(model: str, dtype: str, bandwidth_bytes: int, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.machine", "--model", model, "--dtype", dtype,
           "--bandwidth-bytes", str(bandwidth_bytes)]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=600)
    return dict(json.loads(out.stdout))


def bound_allocator(env: dict[str, str], ours_args: list[str], ours_env: dict[str, str],
                    library: str | None = None) -> tuple[dict[str, str], str]:
    """The bound's environment, on the allocator our server will run on, and that allocator's
    name. The bare step is host-paced, and the allocator moves it: on one H200 it read 4.17
    and 6.34 ms six minutes apart on glibc, and 4.93-4.98 ms in three runs on jemalloc
    (docs/throughput.md, session 15). So a bound on glibc beside a server on jemalloc (the
    `serve` default where Linux has it) would flatter us whenever glibc had a slow moment."""
    server_env = {**os.environ, **env, **ours_env}
    if "libjemalloc" in server_env.get("LD_PRELOAD", ""):
        return {**env, "LD_PRELOAD": server_env["LD_PRELOAD"]}, "jemalloc"
    chosen = reexec_env(early_choice(ours_args, server_env), server_env, library=library)
    if chosen is None:
        return env, "system"
    return {**env, "LD_PRELOAD": chosen["LD_PRELOAD"]}, "jemalloc"


def _bound(model: str, dtype: str, sizes: Sizes, env: dict[str, str]) -> dict[str, Any]:
    """The bare model's prefill rate and decode steps (bench/bound.py), in a child process
    so that its device memory is gone before the servers start."""
    cmd = [sys.executable, "-m", "bench.bound", "--model", model, "--dtype", dtype,
           "--prompt-tokens", str(sizes.prompt_tokens), "--max-tokens", str(sizes.max_tokens),
           "--concurrency", ",".join(str(c) for c in sizes.concurrency)]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=900)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _save_model_dir(model: str, dtype: str, out: Path, env: dict[str, str]) -> float:
    """Write the dummy model for mlx_lm.server in a child process (no device memory kept here)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "engine.dummy_model", str(out), "--model", model, "--dtype", dtype],
                   cwd=ROOT, env={**os.environ, **env}, check=True, timeout=900)
    return time.monotonic() - started


class Run:
    """One results file, rewritten after every scenario."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {**header, "scenarios": {}, "errors": []}
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)

    def record(self, scenario: str, server: str, value: Any) -> None:
        self.data["scenarios"].setdefault(scenario, {})[server] = value
        self.data["derived"] = derived(self.data)
        self.save()

    async def scenario(self, scenario: str, server: Server, fn: Callable[[], Awaitable[Any]]) -> None:
        print(f"[bench] {server.name}: {scenario} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            value = await fn()
        except Exception as exc:  # one scenario failing must not lose the others
            value = {"error": f"{type(exc).__name__}: {exc}", "server_log_tail": server.tail()}
            self.data["errors"].append(f"{server.name}/{scenario}: {type(exc).__name__}: {exc}")
        if isinstance(value, dict):
            value["elapsed_s"] = round(time.monotonic() - started, 2)
        self.record(scenario, server.name, value)
        print(f"[bench] {server.name}: {scenario} done in {time.monotonic() - started:.1f}s",
              file=sys.stderr, flush=True)


def derived(data: dict[str, Any]) -> dict[str, Any]:
    """Headline numbers: C=1 against the bandwidth bound, the guard's cost, prefix hit ratio."""
    out: dict[str, Any] = {}
    bandwidth = (data.get("bandwidth") or {}).get("bytes_per_s")
    weight_bytes = (data.get("model") or {}).get("weight_bytes")
    for server, points in (data["scenarios"].get("throughput") or {}).items():
        if not isinstance(points, list):
            continue
        c1 = next((p for p in points if p["concurrency"] == 1), None)
        if c1 and bandwidth and weight_bytes and c1.get("tpot_ms_p50"):
            bound = bandwidth / weight_bytes
            out[f"{server}_c1_tok_s_per_stream"] = round(1000 / c1["tpot_ms_p50"], 2)
            out[f"{server}_c1_bandwidth_fraction"] = round(1000 / c1["tpot_ms_p50"] / bound, 4)
            out["bandwidth_bound_tok_s"] = round(bound, 2)
    b = data.get("bound")
    if b:
        from bench.bound import bound

        for points in (data["scenarios"].get("throughput") or {}).values():
            if not isinstance(points, list):
                continue
            for p in points:
                key = str(p.get("concurrency"))
                if key in b.get("decode_step_ms", {}) and p.get("output_tok_s") is not None:
                    p.update(bound(b, p["concurrency"], p["requests"]))
                    p["fraction_of_bound"] = round(p["output_tok_s"] / p["bound_tok_s"], 4)
    guard = (data["scenarios"].get("guard") or {}).get("ours") or {}
    if "cost_pct" in guard:
        out["guard_cost_pct"] = guard["cost_pct"]
    for server, prefix in (data["scenarios"].get("prefix") or {}).items():
        if isinstance(prefix, dict) and prefix.get("hit_over_cold") is not None:
            out[f"{server}_prefix_hit_over_cold"] = prefix["hit_over_cold"]
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=sorted(MODES), default="cpu-quick")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {SCENARIOS}")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated: {SERVERS}")
    p.add_argument("--model", help="dummy preset or config.json (default: the mode's)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--tag", help="added to the results file name")
    p.add_argument("--model-dir", type=Path, help="where mlx_lm.server's model is written "
                   "(default: /tmp/mlx-headroom-bench/<model>-<dtype>)")
    p.add_argument("--pressure-ceiling-bytes", type=int,
                   help="simulate a machine of this size for ours in the pressure scenario "
                   "(cpu-quick default: computed so that about 3 prompts fit; 0: real memory)")
    p.add_argument("--bandwidth-bytes", type=int, help="array size of the copy-bandwidth test (0: skip)")
    p.add_argument("--no-bound", action="store_true", help="skip the bare model's bound (bench/bound.py)")
    p.add_argument("--ours-arg", action="append", default=[], help="extra flag for our server")
    p.add_argument("--ours-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for our server, e.g. MLX_HEADROOM_MEMORY_WAIT_TIMEOUT_S=5")
    p.add_argument("--ours-kernel-variant", help="serve ours with this bench.kernel_sweep variant of the "
                   "paged decode kernel (bench.serve_variant)")
    p.add_argument("--mlx-lm-arg", action="append", default=[], help="extra flag for mlx_lm.server")
    for f in dataclasses.fields(Sizes):
        kind = float if f.type == "float" else int
        if f.name == "concurrency":
            p.add_argument("--concurrency", help="comma-separated, e.g. 1,8,32")
        elif f.name == "stream_modes":
            p.add_argument("--stream-modes", help="comma-separated: stream, nonstream (throughput)")
        else:
            p.add_argument("--" + f.name.replace("_", "-"), type=kind)
    return p.parse_args(argv)


def _sizes(args: argparse.Namespace, mode: Mode) -> Sizes:
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(Sizes):
        value = getattr(args, f.name)
        if value is None:
            continue
        if f.name == "concurrency":
            changes[f.name] = tuple(int(x) for x in value.split(","))
        elif f.name == "stream_modes":
            modes = [x.strip() for x in value.split(",") if x.strip()]
            if set(modes) - {"stream", "nonstream"}:
                raise SystemExit(f"--stream-modes takes stream and/or nonstream, not {value!r}")
            changes[f.name] = tuple(m == "stream" for m in modes)
        else:
            changes[f.name] = value
    return dataclasses.replace(mode.sizes, **changes)


async def _with_server(
    server: Server, timeout_s: float, run: Run, body: Callable[[], Awaitable[None]]
) -> None:
    try:
        await asyncio.to_thread(server.start, timeout_s)
    except Exception as exc:
        run.data["errors"].append(f"{server.name}: start failed: {exc}")
        run.save()
        print(f"[bench] {server.name} failed to start: {exc}", file=sys.stderr, flush=True)
        return
    run.data.setdefault("startup_s", {}).setdefault(server.name, []).append(round(server.started_s or 0, 2))
    try:
        await body()
    finally:
        code = server.stop()
        run.data.setdefault("exit_codes", {}).setdefault(server.name, []).append(code)
        run.save()


async def main_async(args: argparse.Namespace) -> Path:
    mode = MODES[args.mode]
    model, dtype = args.model or mode.model, args.dtype or mode.dtype
    sizes = _sizes(args, mode)
    selected = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    for name in selected:
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r}; choose from {SCENARIOS}")
    # the dummy model's tokenizer files go to MLX_HEADROOM_CACHE (default ~/.cache/mlx-headroom)
    env: dict[str, str] = {} if os.environ.get("MLX_HEADROOM_CACHE") else {
        "MLX_HEADROOM_CACHE": "/tmp/mlx-headroom-bench/cache"}
    preload = openblas_preload()
    if preload and not _has_gpu():
        env["LD_PRELOAD"] = preload
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{args.mode}-{stamp}" + (f"-{args.tag}" if args.tag else "")
    log_dir = args.out_dir / "logs" / name
    bandwidth_bytes = mode.bandwidth_bytes if args.bandwidth_bytes is None else args.bandwidth_bytes
    info = _machine(model, dtype, bandwidth_bytes, env)
    ceiling = args.pressure_ceiling_bytes
    if ceiling is None and mode.pressure_fit is not None:
        ceiling = simulated_ceiling(info, sizes, mode.pressure_fit)
    model_info = {k: v for k, v in info["model"].items() if k != "config"}
    run = Run(args.out_dir / f"{name}.json", {
        "run": name, "mode": args.mode, "argv": sys.argv[1:], "started_at": stamp,
        "loadavg_at_start": _loadavg(), "bench_ld_preload": os.environ.get("LD_PRELOAD"),
        "machine": info["machine"], "versions": info["versions"], "model": model_info,
        "model_config": info["model"]["config"], "bandwidth": info.get("bandwidth"),
        "settings": {"sizes": dataclasses.asdict(sizes), "scenarios": selected, "servers": servers,
                     "env": env, "pressure_ceiling_bytes": ceiling or None,
                     "ours_args": args.ours_arg, "ours_env": args.ours_env,
                     "ours_kernel_variant": args.ours_kernel_variant,
                     "mlx_lm_args": args.mlx_lm_arg},
    })
    print(f"[bench] results: {run.path}", file=sys.stderr, flush=True)
    if "throughput" in selected and not args.no_bound:
        print("[bench] measuring the bare model's bound ...", file=sys.stderr, flush=True)
        try:
            bound_env, run.data["bound_malloc"] = bound_allocator(
                env, args.ours_arg, _env_pairs(args.ours_env))
            run.data["bound"] = await asyncio.to_thread(_bound, model, dtype, sizes, bound_env)
        except (subprocess.SubprocessError, ValueError) as exc:
            run.data["errors"].append(f"bound: {exc}")
        run.save()

    if "ours" in servers:
        ours_env = {**env, **_env_pairs(args.ours_env)}
        await _run_ours(run, selected, sizes, model, dtype, ours_env, log_dir, mode, args, ceiling)
    if "mlx_lm" in servers and set(selected) & {"throughput", "prefix", "pressure"}:
        await _run_mlx_lm(run, selected, sizes, model, dtype, env, log_dir, mode, args)
    run.data["finished_at"] = time.strftime("%Y%m%d-%H%M%S")
    run.data["loadavg_at_end"] = _loadavg()  # other work on a shared machine skews the numbers
    run.save()
    return run.path


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _has_gpu() -> bool:
    return subprocess.run(["sh", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0


def _ours(log_dir: Path, env: dict[str, str], model: str, dtype: str, extra: list[str],
          kernel_variant: str | None = None) -> Server:
    launcher = ["server.cli"] if kernel_variant is None else ["bench.serve_variant", kernel_variant]
    args = [*launcher, "serve", "--load-format", "dummy", "--model", model, "--dtype", dtype,
            "--served-model-name", OURS_NAME, "--api-key", API_KEY, "--log-level", "warning", *extra]
    return Server("ours", args, log_dir, env=env, api_key=API_KEY)


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--ours-env wants KEY=VALUE, not {pair!r}")
        out[key] = value
    return out


async def _run_ours(run: Run, selected: list[str], sizes: Sizes, model: str, dtype: str, env: dict[str, str],
                    log_dir: Path, mode: Mode, args: argparse.Namespace, ceiling: int | None) -> None:
    main_scenarios = [s for s in selected if s in ("throughput", "guard", "prefix")]
    if main_scenarios:
        server = _ours(log_dir, env, model, dtype, args.ours_arg, args.ours_kernel_variant)

        async def body() -> None:
            run.data["ours_version"] = await _version(server)  # names the allocator it runs on
            run.record("warmup", "ours", await scenarios.warmup(server, OURS_NAME, sizes.concurrency))
            if "throughput" in selected:
                await run.scenario("throughput", server,
                                   lambda: scenarios.throughput(server, OURS_NAME, sizes))
            if "guard" in selected:
                await run.scenario("guard", server, lambda: scenarios.guard_cost(server, OURS_NAME, sizes))
            if "prefix" in selected:
                await run.scenario("prefix", server, lambda: scenarios.prefix_cache(server, OURS_NAME, sizes))

        await _with_server(server, mode.startup_timeout_s, run, body)
    if "pressure" in selected:
        extra = list(args.ours_arg)
        if ceiling:
            extra += ["--memory-probe", "allocator", "--memory-tier", "custom",
                      "--memory-ceiling-bytes", str(ceiling)]
        server = _ours(log_dir, env, model, dtype, extra, args.ours_kernel_variant)

        async def pressure() -> None:
            await scenarios.warmup(server, OURS_NAME)
            await run.scenario("pressure", server,
                               lambda: scenarios.memory_pressure(server, OURS_NAME, sizes))

        await _with_server(server, mode.startup_timeout_s, run, pressure)


async def _version(server: Server) -> dict[str, Any] | None:
    try:
        async with httpx.AsyncClient(headers=server.headers) as client:
            r = await client.get(server.url + "/v1/version", timeout=5.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _run_mlx_lm(run: Run, selected: list[str], sizes: Sizes, model: str, dtype: str,
                      env: dict[str, str], log_dir: Path, mode: Mode, args: argparse.Namespace) -> None:
    model_dir = args.model_dir or Path("/tmp/mlx-headroom-bench") / f"{Path(model).stem}-{dtype}"
    print(f"[bench] writing the model for mlx_lm.server to {model_dir}", file=sys.stderr, flush=True)
    try:
        run.data["mlx_lm_model_dir"] = {"path": str(model_dir),
                                        "write_s": round(await asyncio.to_thread(
                                            _save_model_dir, model, dtype, model_dir, env), 2)}
    except subprocess.SubprocessError as exc:
        run.data["errors"].append(f"mlx_lm: writing the model failed: {exc}")
        run.save()
        return
    run.save()
    server = Server("mlx_lm", ["mlx_lm.server", "--model", str(model_dir), *args.mlx_lm_arg], log_dir,
                    env=env, api_key=API_KEY)

    async def body() -> None:
        run.record("warmup", "mlx_lm", await scenarios.warmup(server, MLX_LM_NAME, sizes.concurrency))
        if "throughput" in selected:
            await run.scenario("throughput", server, lambda: scenarios.throughput(server, MLX_LM_NAME, sizes))
        if "prefix" in selected:
            await run.scenario("prefix", server, lambda: scenarios.prefix_cache(server, MLX_LM_NAME, sizes))
        if "pressure" in selected:  # last: it is expected to kill mlx_lm.server on a GPU
            await run.scenario("pressure", server,
                               lambda: scenarios.memory_pressure(server, MLX_LM_NAME, sizes))

    await _with_server(server, mode.startup_timeout_s, run, body)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        path = asyncio.run(main_async(args))
    finally:
        stop_all()
    print(path)
    from bench.table import markdown

    data = json.loads(path.read_text())
    print(markdown(data))
    from bench.summary import compact

    print(compact(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
