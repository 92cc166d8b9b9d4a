"""`mlx-headroom serve`: the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from server.settings import Settings


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, so the process would
    die of the signal; a service that drained cleanly should exit 0 instead."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-headroom", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--model", help="mlx-lm model directory or hub id ('default': the embedded tiny model)"
    )
    serve.add_argument(
        "--load-format", choices=["auto", "dummy"],
        help="'dummy': random weights; --model then names a preset (llama3-8b, qwen2.5-7b, tiny) "
        "or a config.json",
    )
    serve.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                       help="weight dtype of a dummy model")
    serve.add_argument("--served-model-name")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int)
    serve.add_argument("--max-concurrency", type=int)
    serve.add_argument("--max-queue", type=int)
    serve.add_argument("--prefill-step-size", type=int)
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
    serve.add_argument("--reserve-context-tokens", type=int,
                       help="tokens of context the model must have room for to load (default 8192)")
    serve.add_argument("--force-load", action="store_true", default=None,
                       help="load the model even when weights + reserve exceed the ceiling")
    sub.add_parser("build-default-model", help="build the embedded default model and print its path")
    from server.doctor import add_doctor_parser

    add_doctor_parser(sub)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        k: v for k, v in vars(args).items() if k != "command" and v is not None
    }
    return Settings(**overrides)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "build-default-model":
        from engine.tiny_model import ensure_default_model

        print(ensure_default_model())
        return 0
    if args.command == "doctor":
        from server.doctor import run_doctor

        return run_doctor(args)
    settings = settings_from_args(args)
    from server.auth import startup_problem

    if (problem := startup_problem(settings)) is not None:
        print(f"mlx-headroom: {problem}", file=sys.stderr)
        return 2
    from server.access_log import configure_logging

    configure_logging(settings.log_level)
    from server.model_fit import EXIT_DOES_NOT_FIT, LoadRefused, admit_load

    try:
        load_admission = admit_load(settings)
    except LoadRefused as exc:
        print(f"mlx-headroom: not loading {settings.public_model_name}: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    from server.app import create_app

    app = create_app(settings, load_admission=load_admission)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,
        access_log=False,
        log_config=None,
    )
    _Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
