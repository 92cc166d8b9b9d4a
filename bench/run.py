"""The benchmark harness: our server, mlx_lm.server and the bare mlx-lm model on the same model.

    python -m bench throughput prefix --mode cpu            # tiny float32 model, minutes here
    python -m bench throughput --mode gpu                   # llama3-8b shape, bf16, on the H200

Ours runs `--load-format dummy`; mlx_lm.server loads the same weights from a directory that
`engine.dummy_model.save_dummy_model` writes (cached between runs); the `quantized` scenario
quantizes that directory with mlx-lm and serves it to both. The bare model's bound
(`bench/bound.py`) runs in a child process before the servers start. Each run writes one
folder, `bench/results/<date>-<machine>-<name>/` (or under `--out-dir`): `run.json` (everything
measured, with the machine, versions and settings) and `summary.json` (one row per measured
point, `bench/summary.py`), both rewritten as each scenario finishes, so a run cut short keeps
what it measured; the servers' logs go to `logs/`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from bench import scenarios, step_log, summary
from bench.machine import git_commit, result_dir
from bench.scenarios import SCENARIOS, Sizes
from bench.servers import ROOT, Server, stop_all
from server.malloc import early_choice, reexec_env

SERVERS = ("ours", "mlx_lm")
API_KEY = "bench-key"
OURS_NAME = "bench"  # --served-model-name
MLX_LM_NAME = "default_model"  # mlx_lm.server's name for its --model
RESULTS = ROOT / "bench" / "results"
WORK = Path("/tmp/mlx-headroom-bench")  # model directories for mlx_lm.server, the tokenizer cache


@dataclasses.dataclass(frozen=True)
class Mode:
    model: str
    dtype: str
    sizes: Sizes
    bandwidth_bytes: int
    pressure_fit: int | None  # simulate a machine where this many overload prompts fit (ours)
    startup_timeout_s: float


MODES: dict[str, Mode] = {
    "cpu": Mode(
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
        sizes=Sizes(concurrency=(1, 32, 64), prompt_tokens=1000, max_tokens=256, guard_concurrency=32,
                    prefix_tokens=8000, prefix_suffix_tokens=64, pressure_requests=40,
                    pressure_prompt_tokens=32768, pressure_max_tokens=16, pressure_timeout_s=900,
                    pressure_deadline_s=240, request_timeout_s=600,
                    prefill_lengths=(1000, 4000, 16000, 32000), interference_concurrency=8,
                    interference_max_tokens=1024, interference_long_tokens=100_000,
                    interference_delay_s=2.0),
    ),
}


def openblas_preload() -> str | None:
    """LD_PRELOAD value for Debian's OpenBLAS (float32 matmuls ~30× the bundled BLAS on a CPU)."""
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        if Path(d, "libopenblas.so.0").exists():
            return "libopenblas.so.0"
    return None


def simulated_ceiling(info: dict[str, Any], sizes: Sizes, fit: int) -> int:
    """A memory ceiling under which about `fit` overload prompts fit at once: the weights, the
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


def _child_json(args: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env={**os.environ, **env},
                         capture_output=True, text=True, check=True, timeout=timeout_s)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _machine(model: str, dtype: str, bandwidth_bytes: int, env: dict[str, str]) -> dict[str, Any]:
    return _child_json(["bench.machine", "--model", model, "--dtype", dtype,
                        "--bandwidth-bytes", str(bandwidth_bytes)], env, 600)


def bound_allocator(env: dict[str, str], ours_args: list[str], ours_env: dict[str, str],
                    library: str | None = None) -> tuple[dict[str, str], str]:
    """The bound's environment, on the allocator our server will run on, and that allocator's
    name. The bare step is host-paced, and the allocator moves it: on one H200 it read 4.17
    and 6.34 ms six minutes apart on glibc, and 4.93-4.98 ms in three runs on jemalloc
    (docs/throughput.md). So a bound on glibc beside a server on jemalloc (the `serve` default
    where Linux has it) would flatter us whenever glibc had a slow moment."""
    server_env = {**os.environ, **env, **ours_env}
    if "libjemalloc" in server_env.get("LD_PRELOAD", ""):
        return {**env, "LD_PRELOAD": server_env["LD_PRELOAD"]}, "jemalloc"
    chosen = reexec_env(early_choice(ours_args, server_env), server_env, library=library)
    if chosen is None:
        return env, "system"
    return {**env, "LD_PRELOAD": chosen["LD_PRELOAD"]}, "jemalloc"


def _bound(model: str, dtype: str, sizes: Sizes, env: dict[str, str], model_dir: Path | None = None
           ) -> dict[str, Any]:
    """The bare model's prefill rate and decode steps (bench/bound.py), in a child process
    so that its device memory is gone before the servers start."""
    args = ["bench.bound", "--model", model, "--dtype", dtype, "--prompt-tokens", str(sizes.prompt_tokens),
            "--max-tokens", str(sizes.max_tokens),
            "--concurrency", ",".join(str(c) for c in sizes.concurrency)]
    if model_dir is not None:
        args += ["--model-dir", str(model_dir)]
    return _child_json(args, env, 900)


def _save_model_dir(model: str, dtype: str, out: Path, env: dict[str, str], bits: int | None = None) -> float:
    """Write the dummy model for mlx_lm.server in a child process (no device memory kept here),
    quantized by mlx-lm to `bits` when given (into `out` itself, from `<out>-full`)."""
    started = time.monotonic()
    full = out.with_name(out.name + "-full") if bits else out
    subprocess.run([sys.executable, "-m", "engine.dummy_model", str(full), "--model", model,
                    "--dtype", dtype], cwd=ROOT, env={**os.environ, **env}, check=True, timeout=900)
    if bits and not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(full), "--mlx-path",
                        str(out), "-q", "--q-bits", str(bits)], cwd=ROOT, env={**os.environ, **env},
                       check=True, timeout=900, capture_output=True)
    return time.monotonic() - started


class Run:
    """One results folder: run.json and summary.json, rewritten after every scenario."""

    def __init__(self, folder: Path, header: dict[str, Any]) -> None:
        self.folder = folder
        self.data: dict[str, Any] = {**header, "scenarios": {}, "errors": []}
        self.save()

    @property
    def path(self) -> Path:
        return self.folder / "run.json"

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, value in (("run.json", self.data), ("summary.json", summary.from_run(self.data))):
            tmp = self.folder / f"{name}.tmp"
            tmp.write_text(json.dumps(value, indent=1, default=str))
            tmp.replace(self.folder / name)

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
    """Headline numbers (C=1 against the bandwidth bound, the guard's cost, the prefix hit
    ratio), and each throughput point's bound and fraction of it."""
    from bench.bound import bound

    out: dict[str, Any] = {}
    bandwidth = (data.get("bandwidth") or {}).get("bytes_per_s")
    weight_bytes = (data.get("model") or {}).get("weight_bytes")
    for server, points in (data["scenarios"].get("throughput") or {}).items():
        if not isinstance(points, list):
            continue
        c1 = next((p for p in points if p["concurrency"] == 1), None)
        if c1 and bandwidth and weight_bytes and c1.get("tpot_ms_p50"):
            limit = bandwidth / weight_bytes
            out[f"{server}_c1_tok_s_per_stream"] = round(1000 / c1["tpot_ms_p50"], 2)
            out[f"{server}_c1_bandwidth_fraction"] = round(1000 / c1["tpot_ms_p50"] / limit, 4)
            out["bandwidth_bound_tok_s"] = round(limit, 2)
    for scenario, key in (("throughput", "bound"), ("quantized", "bound_quantized")):
        b = data.get(key)
        if not b:
            continue
        for points in (data["scenarios"].get(scenario) or {}).values():
            if not isinstance(points, list):
                continue
            for p in points:
                measured = p.get("output_tok_s") is not None
                if measured and str(p.get("concurrency")) in b.get("decode_step_ms", {}):
                    p.update(bound(b, p["concurrency"], p["requests"]))
                    p["fraction_of_bound"] = round(p["output_tok_s"] / p["bound_tok_s"], 4)
    _weight_bandwidth(data)
    guard = (data["scenarios"].get("guard") or {}).get("ours") or {}
    if "cost_pct" in guard:
        out["guard_cost_pct"] = guard["cost_pct"]
    for server, prefix in (data["scenarios"].get("prefix") or {}).items():
        if isinstance(prefix, dict) and prefix.get("hit_over_cold") is not None:
            out[f"{server}_prefix_hit_over_cold"] = prefix["hit_over_cold"]
    return out


def _weight_bandwidth(data: dict[str, Any]) -> None:
    """Each quantized point's weight bandwidth: every decode step reads the quantized weights
    once, and the steady per-token time is the step's time at that batch, so bytes/s is
    weights over it, and its fraction is of the card's HBM bandwidth (its datasheet's)."""
    from bench.bound import peak_bandwidth

    weight_bytes = (data.get("quantized") or {}).get("weight_bytes")
    peak = peak_bandwidth(data)
    for points in (data["scenarios"].get("quantized") or {}).values():
        for p in points if isinstance(points, list) else []:
            step_ms = p.get("steady_tpot_ms_p50")
            if weight_bytes and step_ms:
                p["weight_bytes_per_s"] = round(weight_bytes / (step_ms / 1000))
                if peak:
                    p["weight_bandwidth_fraction"] = round(p["weight_bytes_per_s"] / peak, 4)


def parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {s.name:<13} {s.help} [{', '.join(s.servers)}]" for s in SCENARIOS.values())
    p = argparse.ArgumentParser(
        prog="python -m bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark mlx-headroom beside mlx_lm.server and the bare mlx-lm model.",
        epilog=f"scenarios:\n{listing}\n\n"
               "tools (each takes its own --help):\n"
               "  python -m bench table  RESULT_DIR     the results as a markdown table\n"
               "  python -m bench plot   RESULT_DIR     the results as one PNG (the bench extra)\n"
               "  python -m bench summary RESULT_DIR    per-point detail for a terminal\n"
               "  python -m bench convert FILE --out DIR   an older results JSON to summary.json\n"
               "  python -m bench merge OUT_DIR DIR...  the rows of several runs in one summary.json\n"
               "  python -m bench.soak                  minutes of mixed traffic, then leak checks\n"
               "  python -m bench.device_agreement      our memory figure against the driver's\n\n"
               "Results: bench/results/<date>-<machine>-<name>/ with run.json and summary.json "
               "(docs/benchmarks.md).")
    p.add_argument("scenarios", nargs="+", metavar="SCENARIO", help=f"one or more of: {', '.join(SCENARIOS)}")
    p.add_argument("--mode", choices=sorted(MODES), default="cpu",
                   help="cpu: the tiny float32 model and small sizes; gpu: llama3-8b bf16 (default: cpu)")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated: {', '.join(SERVERS)}")
    p.add_argument("--model", help="dummy preset or config.json (default: the mode's)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where the results folder goes")
    p.add_argument("--name", help="the results folder's last part (default: the scenarios' names)")
    p.add_argument("--model-dir", type=Path, help="where mlx_lm.server's model is written "
                   f"(default: {WORK}/<model>-<dtype>)")
    p.add_argument("--pressure-ceiling-bytes", type=int,
                   help="simulate a machine of this size for ours in the overload scenario "
                   "(cpu default: computed so that about 3 prompts fit; 0: real memory)")
    p.add_argument("--bandwidth-bytes", type=int, help="array size of the copy-bandwidth test (0: skip)")
    p.add_argument("--no-bound", action="store_true", help="skip the bare model's bound (bench/bound.py)")
    p.add_argument("--ours-arg", action="append", default=[], help="extra flag for our server")
    p.add_argument("--ours-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for our server, e.g. MLX_HEADROOM_MEMORY_WAIT_TIMEOUT_S=5")
    p.add_argument("--mlx-lm-arg", action="append", default=[], help="extra flag for mlx_lm.server")
    sizes = p.add_argument_group("sizes", "each overrides the mode's (bench/run.py MODES; the pressure_* "
                                 "sizes are the overload scenario's)")
    for f in dataclasses.fields(Sizes):
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("concurrency", "prefill_lengths"):
            sizes.add_argument(flag, help="comma-separated, e.g. 1,8,32")
        elif f.name == "stream_modes":
            sizes.add_argument(flag, help="comma-separated: stream, nonstream (throughput)")
        else:
            sizes.add_argument(flag, type=float if f.type == "float" else int)
    return p


def _sizes(args: argparse.Namespace, mode: Mode) -> Sizes:
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(Sizes):
        value = getattr(args, f.name)
        if value is None:
            continue
        if f.name in ("concurrency", "prefill_lengths"):
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


async def main_async(args: argparse.Namespace, argv: list[str]) -> Path:
    mode = MODES[args.mode]
    model, dtype = args.model or mode.model, args.dtype or mode.dtype
    sizes = _sizes(args, mode)
    selected = list(dict.fromkeys(args.scenarios))
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    for name in selected:
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    for name in servers:
        if name not in SERVERS:
            raise SystemExit(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")
    # the dummy model's tokenizer files go to MLX_HEADROOM_CACHE (default ~/.cache/mlx-headroom)
    env: dict[str, str] = {} if os.environ.get("MLX_HEADROOM_CACHE") else {
        "MLX_HEADROOM_CACHE": str(WORK / "cache")}
    preload = openblas_preload()
    if preload and not _has_gpu():
        env["LD_PRELOAD"] = preload
    bandwidth_bytes = mode.bandwidth_bytes if args.bandwidth_bytes is None else args.bandwidth_bytes
    info = _machine(model, dtype, bandwidth_bytes, env)
    folder = result_dir(args.out_dir, info["machine"], args.name or "-".join(selected))
    ceiling = args.pressure_ceiling_bytes
    if ceiling is None and mode.pressure_fit is not None:
        ceiling = simulated_ceiling(info, sizes, mode.pressure_fit)
    model_info = {k: v for k, v in info["model"].items() if k != "config"}
    run = Run(folder, {
        "run": folder.name, "mode": args.mode, "command": "python -m bench " + shlex.join(argv),
        "commit": git_commit(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "loadavg_at_start": _loadavg(), "bench_ld_preload": os.environ.get("LD_PRELOAD"),
        "machine": info["machine"], "versions": info["versions"], "model": model_info,
        "model_config": info["model"]["config"], "bandwidth": info.get("bandwidth"),
        "settings": {"sizes": dataclasses.asdict(sizes), "scenarios": selected, "servers": servers,
                     "env": env, "pressure_ceiling_bytes": ceiling or None,
                     "ours_args": args.ours_arg, "ours_env": args.ours_env, "mlx_lm_args": args.mlx_lm_arg},
    })
    print(f"[bench] results: {folder}", file=sys.stderr, flush=True)
    ours_env = {**env, **_env_pairs(args.ours_env)}
    model_dir = args.model_dir or WORK / f"{Path(model).stem}-{dtype}"
    quantized_dir = model_dir.with_name(model_dir.name + f"-q{sizes.quantized_bits}")
    if "quantized" in selected:
        print(f"[bench] writing the quantized model to {quantized_dir}", file=sys.stderr, flush=True)
        try:
            await asyncio.to_thread(_save_model_dir, model, dtype, quantized_dir, env, sizes.quantized_bits)
            weights = sum(f.stat().st_size for f in quantized_dir.glob("*.safetensors"))
            run.data["quantized"] = {"path": str(quantized_dir), "bits": sizes.quantized_bits,
                                     "weight_bytes": weights}
        except subprocess.SubprocessError as exc:
            run.data["errors"].append(f"quantized: writing the model failed: {exc}")
            selected.remove("quantized")
    if not args.no_bound and {"throughput", "quantized"} & set(selected):
        print("[bench] measuring the bare model's bound ...", file=sys.stderr, flush=True)
        bound_env, run.data["bound_malloc"] = bound_allocator(env, args.ours_arg, _env_pairs(args.ours_env))
        bounds = (("throughput", "bound", None), ("quantized", "bound_quantized", quantized_dir))
        for scenario, key, path in bounds:
            if scenario in selected:
                try:
                    run.data[key] = await asyncio.to_thread(_bound, model, dtype, sizes, bound_env, path)
                except (subprocess.SubprocessError, ValueError) as exc:
                    run.data["errors"].append(f"{key}: {exc}")
        run.save()
    log_dir = folder / "logs"
    if "ours" in servers:
        await _run_ours(run, selected, sizes, model, dtype, ours_env, log_dir, mode, args, ceiling,
                        quantized_dir)
        steps = step_log.from_logs(sorted(log_dir.glob("ours-*.log")))
        if steps:  # our server ran at --log-level debug: its prefill steps by context
            run.data["engine_steps"] = steps
            for row in steps:
                print(f"[bench] ours steps: {json.dumps(row)}", file=sys.stderr, flush=True)
    if "mlx_lm" in servers:
        await _run_mlx_lm(run, selected, sizes, model, dtype, env, log_dir, mode, args, model_dir,
                          quantized_dir)
    run.data["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    run.data["loadavg_at_end"] = _loadavg()  # other work on a shared machine skews the numbers
    run.save()
    return folder


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _has_gpu() -> bool:
    return subprocess.run(["sh", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0


def _ours(log_dir: Path, env: dict[str, str], model: str, dtype: str | None, extra: list[str]) -> Server:
    load = ["--load-format", "dummy", "--dtype", str(dtype)] if dtype else []
    args = ["server.cli", "serve", *load, "--model", model, "--served-model-name", OURS_NAME,
            "--api-key", API_KEY, "--log-level", "warning", *extra]
    return Server("ours", args, log_dir, env=env, api_key=API_KEY)


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--ours-env wants KEY=VALUE, not {pair!r}")
        out[key] = value
    return out


def _shared(selected: list[str], server: str) -> list[str]:
    """The scenarios that run on one shared server, in the table's order (overload last)."""
    order = [s for s in SCENARIOS if s in selected and server in SCENARIOS[s].servers]
    shared = [s for s in order if not SCENARIOS[s].own_server]
    return shared + (["overload"] if "overload" in order and server == "mlx_lm" else [])


async def _run_scenarios(run: Run, server: Server, name: str, names: list[str], sizes: Sizes,
                         warm_concurrency: tuple[int, ...]) -> None:
    run.record("warmup", server.name, await scenarios.warmup(server, name, warm_concurrency))
    for scenario in names:
        fn = SCENARIOS[scenario].run
        await run.scenario(scenario, server, lambda fn=fn: fn(server, name, sizes))  # type: ignore[misc]


async def _run_ours(run: Run, selected: list[str], sizes: Sizes, model: str, dtype: str, env: dict[str, str],
                    log_dir: Path, mode: Mode, args: argparse.Namespace, ceiling: int | None,
                    quantized_dir: Path) -> None:
    shared = _shared(selected, "ours")
    if shared:
        server = _ours(log_dir, env, model, dtype, args.ours_arg)

        async def body() -> None:
            run.data["ours_version"] = await _version(server)  # names the allocator it runs on
            await _run_scenarios(run, server, OURS_NAME, shared, sizes, sizes.concurrency)

        await _with_server(server, mode.startup_timeout_s, run, body)
    if "overload" in selected:
        extra = list(args.ours_arg)
        if ceiling:
            extra += ["--memory-probe", "allocator", "--memory-tier", "custom",
                      "--memory-ceiling-bytes", str(ceiling)]
        server = _ours(log_dir, env, model, dtype, extra)

        async def overload() -> None:
            await _run_scenarios(run, server, OURS_NAME, ["overload"], sizes, (1,))

        await _with_server(server, mode.startup_timeout_s, run, overload)
    if "prefix-disk" in selected:
        disk_dir = log_dir / "prefix-disk"
        server = _ours(log_dir, env, model, dtype, [*args.ours_arg, "--prefix-cache-dir", str(disk_dir)])

        async def prefix_disk() -> None:
            await _run_scenarios(run, server, OURS_NAME, ["prefix-disk"], sizes, (1,))

        await _with_server(server, mode.startup_timeout_s, run, prefix_disk)
    if "quantized" in selected:
        server = _ours(log_dir, env, str(quantized_dir), None, args.ours_arg)

        async def quantized() -> None:
            await _run_scenarios(run, server, OURS_NAME, ["quantized"], sizes, sizes.concurrency)

        await _with_server(server, mode.startup_timeout_s, run, quantized)


async def _version(server: Server) -> dict[str, Any] | None:
    try:
        async with httpx.AsyncClient(headers=server.headers) as client:
            r = await client.get(server.url + "/v1/version", timeout=5.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _run_mlx_lm(run: Run, selected: list[str], sizes: Sizes, model: str, dtype: str,
                      env: dict[str, str], log_dir: Path, mode: Mode, args: argparse.Namespace,
                      model_dir: Path, quantized_dir: Path) -> None:
    shared = _shared(selected, "mlx_lm")
    if shared:
        print(f"[bench] writing the model for mlx_lm.server to {model_dir}", file=sys.stderr, flush=True)
        try:
            run.data["mlx_lm_model_dir"] = {"path": str(model_dir),
                                            "write_s": round(await asyncio.to_thread(
                                                _save_model_dir, model, dtype, model_dir, env), 2)}
        except subprocess.SubprocessError as exc:
            run.data["errors"].append(f"mlx_lm: writing the model failed: {exc}")
            run.save()
            shared = []
        run.save()
    # overload runs last on the shared server: it is expected to kill mlx_lm.server on a GPU
    quantized = ["quantized"] if "quantized" in selected else []
    for names, directory in ((shared, model_dir), (quantized, quantized_dir)):
        if not names:
            continue
        server = Server("mlx_lm", ["mlx_lm.server", "--model", str(directory), *args.mlx_lm_arg], log_dir,
                        env=env, api_key=API_KEY)

        async def body(server: Server = server, names: list[str] = names) -> None:
            await _run_scenarios(run, server, MLX_LM_NAME, names, sizes, sizes.concurrency)

        await _with_server(server, mode.startup_timeout_s, run, body)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        folder = asyncio.run(main_async(args, argv))
    finally:
        stop_all()
    print(folder)
    from bench.table import markdown

    data = json.loads((folder / "run.json").read_text())
    print(markdown(data))
    print(summary.compact(data))
    return 0
