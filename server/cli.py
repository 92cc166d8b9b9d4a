"""`mlx-headroom serve`: the command line."""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.http_server import HTTPServer
    from server.settings import Settings

# Only what every subcommand needs is imported here: `serve` on jemalloc re-executes itself
# first thing, and the settings, uvicorn and the app are imported after that.

# How `serve` exits, in one place (a supervisor acts on these; server.service.fatal):
EXIT_OK = 0  # a clean stop: SIGTERM drained what was in flight
EXIT_ENGINE_DIED = 1  # the engine died: a supervisor should start a fresh process
EXIT_BAD_SETTINGS = 2  # flags or settings that cannot be served (argparse's code too)
EXIT_STARTUP_FAILED = 3  # the model or the machine could not be read, the model could not
#                          load, or the port could not be bound for another reason than being
#                          in use, such as a privileged port (uvicorn's own code)
EXIT_DOES_NOT_FIT = 4  # load admission: the model does not fit (server.model_fit)
EXIT_PORT_IN_USE = 5  # the port is held by another process, or still by the one this replaces:
#                       transient, so a supervisor restarts it (not a configuration error)
# The configuration errors, 2, 3 and 4: a restart would fail the same way, so systemd's unit
# does not restart them (RestartPreventExitStatus=), and with --fatal-file the server records
# why and exits 0, which launchd's KeepAlive {SuccessfulExit: false} does not restart.
CONFIGURATION_ERRORS = frozenset({EXIT_BAD_SETTINGS, EXIT_STARTUP_FAILED, EXIT_DOES_NOT_FIT})
LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_BACKUPS = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-headroom", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--model", action="append",
        help="mlx-lm model directory, hub id or .gguf file ('tiny': the embedded random model; "
        "'gemma-3-270m': Gemma 3 270M from the [gemma] extra; 'default', when unset: Gemma if "
        "installed, else tiny); repeat it "
        "to load several models (the first is the default one)",
    )
    serve.add_argument(
        "--load-format", choices=["auto", "dummy"],
        help="'dummy': random weights; --model then names a preset (llama3-8b, llama3-70b, qwen2.5-7b, tiny) "
        "or a config.json",
    )
    serve.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                       help="weight dtype of a dummy model")
    serve.add_argument("--served-model-name")
    serve.add_argument("--model-alias", dest="model_aliases", action="append", metavar="NAME=SERVED",
                       help="answer requests for NAME with the served model (repeatable); NAME may "
                       "be a glob: 'claude-*=my-model' serves Claude Code, '*=my-model' any name")
    serve.add_argument("--context-length", type=int,
                       help="serve the model at this context: lower than its own, or higher where "
                       "its RoPE scaling (yarn, llama3, linear, dynamic) reaches; load admission "
                       "then reserves KV for all of it unless --reserve-context-tokens says less "
                       "(default: the model's own)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int)
    serve.add_argument("--max-concurrency", type=int)
    serve.add_argument("--max-queue", type=int)
    serve.add_argument("--prefill-step-size", type=int)
    serve.add_argument("--max-step-tokens", type=int,
                       help="tokens per engine step, one per decoding row plus prefill chunks "
                       "(default: four prefill steps on CUDA, one elsewhere)")
    serve.add_argument("--prefill-batch", type=int,
                       help="most prompts' chunks one prefill model call takes (default 8; 1: one each)")
    serve.add_argument("--max-decode-stall-ms", type=float,
                       help="while streams decode, cut each step's prefill to what keeps the step "
                       "within this many ms, by the measured cost of a prefill token at its context "
                       "(0: off; default 100 on GPUs, 250 on the CPU)")
    serve.add_argument("--prefill-key-bucket", type=int, default=None,
                       help="pad prefill attention's keys to a power of two below N or a multiple of "
                       "N, so that attention planned per shape reuses its plans (default: 4096 on "
                       "CUDA, 0 = never elsewhere)")
    serve.add_argument("--prefill-plan-ms", type=float, default=None,
                       help="what planning a new prefill attention shape costs: a call whose key "
                       "padding would cost more attends its exact keys (default: timed at start-up on CUDA)")
    serve.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                       help="replay decode steps from traced graphs once the batch holds still "
                       "(default: on CUDA only, where it was measured to win)")
    serve.add_argument("--plan-ahead", action=argparse.BooleanOptionalAction, default=None,
                       help="while a prompt's prefill chunk runs, plan the next chunk's attention "
                       "shape so it attends exact keys (default: on; only where shapes are "
                       "planned, CUDA)")
    serve.add_argument("--paged-windows", action=argparse.BooleanOptionalAction, default=None,
                       help="hold sliding-window layers (Gemma 3, gpt-oss...) in the paged KV store at "
                       "their window (default: on; off serves them through mlx-lm's own caches)")
    serve.add_argument("--paged-states", action=argparse.BooleanOptionalAction, default=None,
                       help="hold hybrids' attention layers (Qwen3-Next, Qwen3.5, LFM2, Nemotron-H) in "
                       "the paged KV store, their recurrent state beside it (default: on; off serves "
                       "them through mlx-lm's own caches)")
    serve.add_argument("--paged-gather", action=argparse.BooleanOptionalAction, default=None,
                       help="hold MLA models' caches (DeepSeek, Kimi, GLM-4.7-Flash) in the paged KV "
                       "store, their own attention on each row's gathered K/V (default: on; off serves "
                       "them through mlx-lm's own caches)")
    serve.add_argument("--slice-decode", action=argparse.BooleanOptionalAction, default=None,
                       help="attend a lone decoding row on consecutive KV blocks as one slice of the "
                       "pool by MLX's fused SDPA, stepped eagerly (default: always where steps are "
                       "eager; where they are replayed, the faster path as timed on the first lone rows, and "
                       "timed again when the kept one slows)")
    serve.add_argument("--malloc", choices=["auto", "system"],
                       help="auto (default): on Linux, serve on jemalloc where it is installed, which cut "
                       "the engine's host work per decode step by about a third on the CPU backend "
                       "and the H200's batch-1 step by 15 %%; system: the C library's")
    serve.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                       help="run a few small requests before serving, so first-use kernel compilation "
                       "is not paid inside requests (default: on CUDA only)")
    serve.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=None,
                       help="one matmul for q/k/v and one for gate/up per layer, fused at load "
                       "(default on)")
    serve.add_argument("--small-m-kernel", action=argparse.BooleanOptionalAction, default=None,
                       help="on CUDA, quantized products of up to 64 rows (a decode batch) take the "
                       "project's tensor-core kernel where it times faster than MLX's at load "
                       "(default off)")
    serve.add_argument("--kv-bits", type=int, choices=[4, 8],
                       help="hold keys and values quantized to 8 or 4 bits (with a scale and a bias "
                       "per --kv-group-size values); the guard counts the quantized size "
                       "(default: the model's dtype)")
    serve.add_argument("--kv-group-size", type=int, choices=[32, 64, 128],
                       help="values per scale and bias of quantized KV (default 64; must divide "
                       "the model's head_dim)")
    serve.add_argument("--speculative", choices=["off", "prompt-lookup", "draft-model"],
                       help="speculative decoding, exact (greedy output unchanged, sampling from the "
                       "same distribution): prompt-lookup drafts from each request's own prompt and "
                       "output, draft-model from --draft-model (default off)")
    serve.add_argument("--draft-model",
                       help="a smaller model with the model's tokenizer whose greedy tokens are the "
                       "drafts (a path, hub id or named model); implies --speculative draft-model")
    serve.add_argument("--num-speculative-tokens", type=int,
                       help="drafts per request and step, at most (default 4)")
    serve.add_argument("--speculative-max-rows", type=int,
                       help="speculate only while at most this many requests decode; above it the "
                       "batch is compute-bound and speculation turns itself off (default: 8 on CUDA, "
                       "2 on the CPU, 4 on Metal)")
    serve.add_argument("--prefix-cache-bytes", type=int,
                       help="cap the prefix cache (0: off; default: no cap, it fills what admission "
                       "leaves free under the memory ceiling and is evicted first)")
    serve.add_argument("--prefix-cache-dir",
                       help="keep blocks evicted from the prefix cache in this directory, read back on "
                       "a later hit when that is faster than prefilling; survives restarts (default: off)")
    serve.add_argument("--prefix-cache-disk-bytes", type=int,
                       help="the prefix cache directory's size, at most (default 16 GiB)")
    serve.add_argument("--gil-switch-interval-ms", type=float,
                       help="how long a thread waiting for Python's GIL waits before the holder is made "
                       "to let go, while the engine runs (sys.setswitchinterval; default 1)")
    serve.add_argument("--memory-tier", choices=["safe", "balanced", "aggressive", "custom"])
    serve.add_argument("--memory-ceiling-bytes", type=int)
    serve.add_argument("--memory-probe", choices=["auto", "macos", "linux", "cuda", "allocator"])
    serve.add_argument("--no-memory-guard", dest="memory_guard", action="store_false", default=None)
    serve.add_argument("--api-key")
    serve.add_argument("--admin-key", help="key for admin routes (default: the API key)")
    serve.add_argument("--allow-unauthenticated", action="store_true", default=None,
                       help="serve a non-loopback address without any key")
    serve.add_argument("--cors-origin", dest="cors_origins", action="append",
                       help="allow this origin by CORS (repeatable; default: CORS off)")
    serve.add_argument("--allowed-host", dest="allowed_hosts", action="append",
                       help="also answer to this Host name (repeatable; e.g. a LAN name or a reverse "
                       "proxy's; '*' turns the DNS-rebinding check off)")
    serve.add_argument("--max-body-bytes", type=int)
    serve.add_argument("--request-timeout-s", type=float)
    serve.add_argument("--log-prompts", action="store_true", default=None,
                       help="put prompt and completion text in the access log")
    serve.add_argument("--log-level")
    serve.add_argument("--log-file", type=Path,
                       help="write the log to this file, rotated by size, instead of stderr "
                       "(what `service install` sets on macOS)")
    serve.add_argument("--log-max-bytes", type=int, default=LOG_MAX_BYTES,
                       help=f"rotate --log-file at this size (default {LOG_MAX_BYTES})")
    serve.add_argument("--log-backups", type=int, default=LOG_BACKUPS,
                       help=f"rotated files kept beside --log-file (default {LOG_BACKUPS})")
    serve.add_argument("--fatal-file", type=Path,
                       help="on a configuration error (exit 2, 3 or 4) write why to this file and "
                       "exit 0, so that a supervisor restarting failed processes (launchd's "
                       "KeepAlive) does not retry it forever; removed at start (a port in use, "
                       "exit 5, is not recorded: a restart may find it free)")
    serve.add_argument("--responses-store-entries", type=int)
    serve.add_argument("--responses-store-bytes", type=int)
    serve.add_argument("--tensor-parallel", type=int, help="split the model across N ranks "
                       "started by MLX's launcher (mlx.launch); rank 0 serves HTTP")
    serve.add_argument("--hostfile", help="MLX hostfile: ranks on several machines (e.g. Macs over "
                       "Thunderbolt)")
    serve.add_argument("--backend", choices=["auto", "ring", "jaccl", "nccl"],
                       help="mx.distributed backend (default: nccl on CUDA, else ring)")
    serve.add_argument("--tp-port", type=int, help="first port the ranks connect on (default 32323)")
    serve.add_argument("--tp-timeout-s", type=float,
                       help="fail the group when no collective returns for this long (default 60)")
    serve.add_argument("--env-file", help="read MLX_HEADROOM_* settings (e.g. keys) from this file "
                       "instead of ./.env (what `service install` writes, mode 0600)")
    # several models (docs/multi-model.md)
    serve.add_argument("--allowed-models", action="append",
                       help="a model that may be loaded on demand, or a directory of model "
                       "directories (repeatable, or comma-separated)")
    serve.add_argument("--pin", action="append", help="a model never unloaded (repeatable)")
    serve.add_argument("--idle-unload-s", type=float,
                       help="unload a model after this many seconds without requests")
    serve.add_argument("--reserve-context-tokens", type=int,
                       help="tokens of context the model must have room for to load (default: "
                       "--context-length when given, else 8192)")
    serve.add_argument("--force-load", action="store_true", default=None,
                       help="load the model even when weights + reserve exceed the ceiling")
    sub.add_parser("build-default-model", help="build the embedded default model and print its path")
    sub.add_parser("service", add_help=False,
                   help="run under launchd/systemd: install | uninstall | status | logs "
                   "(`mlx-headroom service --help`)")
    from server.doctor import add_doctor_parser

    add_doctor_parser(sub)
    return parser


# serve flags about the process, not the server's settings
_PROCESS_FLAGS = ("command", "env_file", "log_file", "log_max_bytes", "log_backups", "fatal_file")


def settings_from_args(args: argparse.Namespace) -> Settings:
    from server.settings import Settings

    overrides: dict[str, Any] = {
        k: v for k, v in vars(args).items() if k not in _PROCESS_FLAGS and v is not None
    }
    models = overrides.get("model")
    if isinstance(models, list):  # `serve --model` is repeatable: the first is the default
        overrides["model"] = models[0]
        if models[1:]:
            overrides["extra_models"] = models[1:]
    env_file = getattr(args, "env_file", None)
    if env_file is not None:
        if not os.path.isfile(env_file):
            raise ValueError(f"--env-file {env_file}: no such file")
        return Settings(_env_file=env_file, **overrides)  # type: ignore[call-arg]
    return Settings(**overrides)


def _check_serve_flags(argv: list[str]) -> str | None:
    """For `service install`: the serve flags parse, and the settings they make can start."""
    from server.auth import startup_problem

    try:
        args = _parser().parse_args(["serve", *argv])
    except SystemExit:
        return "invalid serve flags (see `mlx-headroom serve --help`)"
    return startup_problem(settings_from_args(args))


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None  # only then is this process's own command line ours to re-run
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # transformers writes its warnings to stderr in its own format, past our JSON log (one
        # says a long prompt exceeds the tokenizer's nominal length; admission checks the real
        # context itself): only its errors, unless the operator asks for more.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from server.mlx_env import apply_defaults

        apply_defaults(os.environ)  # before MLX runs anything (server.mlx_env says why)
    if from_command_line and argv[:1] == ["serve"]:
        from server.malloc import early_choice, serve_on_jemalloc

        serve_on_jemalloc(early_choice(argv, dict(os.environ)))  # returns where it does not re-execute
    if argv[:1] == ["service"]:
        from server.service import main as service_main

        return service_main(argv[1:], validate=_check_serve_flags)
    fatal_file = _fatal_file(argv)
    if fatal_file is not None:
        from server.service import fatal

        fatal.clear(fatal_file)
    errors = io.StringIO()
    try:
        with redirect_stderr(errors):
            args = _parser().parse_args(argv)
    except SystemExit as exc:
        sys.stderr.write(errors.getvalue())
        if exc.code != EXIT_BAD_SETTINGS:
            raise
        return _stop(fatal_file, EXIT_BAD_SETTINGS, errors.getvalue().strip().splitlines()[-1:])
    if args.command == "build-default-model":
        from engine.tiny_model import ensure_default_model

        print(ensure_default_model())
        return 0
    if args.command == "doctor":
        from server.doctor import run_doctor

        return run_doctor(args)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:  # pydantic's ValidationError: a setting that cannot be served
        return _stop(fatal_file, EXIT_BAD_SETTINGS, exc)
    from server.auth import startup_problem

    if (problem := startup_problem(settings)) is not None:
        return _stop(fatal_file, EXIT_BAD_SETTINGS, problem)
    from engine.logs import configure_logging

    if from_command_line:
        from server.malloc import leave_jemalloc

        leave_jemalloc(settings.malloc)
    configure_logging(settings.log_level)
    _log_to_file(args)
    if (settings.tensor_parallel > 1 or settings.hostfile) and "MLX_RANK" not in os.environ:
        from engine.distributed import launcher
        from server.engine_config import group_config

        return launcher.launch(group_config(settings), argv)  # starts every rank, rank 0 included
    from server.model_fit import LoadRefused, admit_load

    try:
        # Tensor parallel: each rank holds 1/N of the weights, which load admission does not
        # model yet; the ranks' guard still admits every request on the tightest rank.
        tensor_parallel = settings.tensor_parallel > 1 or settings.hostfile
        load_admission = None if tensor_parallel else admit_load(settings)
    except LoadRefused as exc:
        return _stop(fatal_file, exc.exit_code, f"not loading {settings.public_model_name}: {exc}")
    import uvicorn

    from server.app import create_app
    from server.http_server import HTTPServer

    servers: list[HTTPServer] = []
    extra: dict[str, Any] = {}
    if settings.tensor_parallel > 1 or settings.hostfile:
        from engine.distributed import launcher
        from server.engine_config import engine_config, group_config, make_guard

        rank = launcher.join_group(group_config(settings), engine_config(settings),
                                   lambda probe: make_guard(settings, probe))
        if not rank.leader:
            return rank.follow()
        extra = rank.app_hooks()
    on_death = extra.pop("on_engine_death", lambda exc: servers[0].fail(exc, EXIT_ENGINE_DIED))
    app = create_app(settings, load_admission=load_admission, on_engine_death=on_death, **extra)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,
        access_log=False,
        log_config=None,
    )
    server = HTTPServer(config)
    servers.append(server)
    if extra:
        rank.attach(app, server)
    with _first_error() as first_error:
        try:
            server.run()
        except SystemExit as exc:  # uvicorn's 3: the app did not start, or the bind failed
            if exc.code != EXIT_STARTUP_FAILED:
                raise
    if server.port_in_use:
        return _port_in_use(settings.host, settings.port)
    if not server.started:
        return _stop(fatal_file, EXIT_STARTUP_FAILED, first_error() or "the server did not start")
    if server.exit_code == 0 and not app.state.server.engine.stopped_cleanly:
        print("mlx-headroom: the engine did not stop cleanly", file=sys.stderr)
        return EXIT_ENGINE_DIED
    return server.exit_code


def _fatal_file(argv: list[str]) -> Path | None:
    """`serve --fatal-file`, read before the full parse, which may be what fails."""
    if argv[:1] != ["serve"]:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--fatal-file", type=Path)
    known, _ = parser.parse_known_args(argv[1:])
    path: Path | None = known.fatal_file
    return path


def _stop(fatal_file: Path | None, code: int, reason: object) -> int:
    """A configuration error: say why; with --fatal-file record it and exit 0 (launchd's
    KeepAlive would restart a non-zero exit every 10 s, and it would fail the same way)."""
    text = " ".join(str(r) for r in reason) if isinstance(reason, list) else str(reason)
    text = text.removeprefix("mlx-headroom: ").strip() or f"exit {code}"
    print(f"mlx-headroom: {text}", file=sys.stderr)
    if fatal_file is None:
        return code
    from server.service import fatal

    fatal.write(fatal_file, code, text)
    print(f"mlx-headroom: a configuration error (exit {code}): recorded in {fatal_file}; "
          f"exiting {EXIT_OK} so that the supervisor does not restart it", file=sys.stderr)
    return EXIT_OK


def _port_in_use(host: str, port: int) -> int:
    """The port is taken: say by whom where psutil can tell, and exit with a code that is
    not a configuration error, never recorded in --fatal-file, so that the supervisor tries
    again (the holder may be the process this one replaces, still draining)."""
    from server.http_server import port_holder

    holder = port_holder(port)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    held_by = f"held by {holder}" if holder else f"`lsof -nP -iTCP:{port}` names the holder"
    logging.getLogger("mlx_headroom.server").error(
        "cannot listen on %s: address already in use (%s); exiting %d, which a supervisor "
        "restarts", address, held_by, EXIT_PORT_IN_USE,
        extra={"host": host, "port": port, "held_by": holder})
    return EXIT_PORT_IN_USE


def _log_to_file(args: argparse.Namespace) -> None:
    if getattr(args, "log_file", None) is not None:
        from server.log_file import log_to_file

        log_to_file(args.log_file, max_bytes=args.log_max_bytes, backups=args.log_backups)


class _FirstError(logging.Handler):
    """Keeps the first error logged (with its exception), the reason a start-up failed."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.reason: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.reason is None:
            exc = record.exc_info[1] if record.exc_info else None
            self.reason = record.getMessage() + (f": {type(exc).__name__}: {exc}" if exc else "")


@contextmanager
def _first_error() -> Iterator[Any]:
    handler = _FirstError()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield lambda: handler.reason
    finally:
        root.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
