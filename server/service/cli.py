"""The `service` command line. Serve flags given to `install` are checked with the serve
parser, then written into the service (keys into its 0600 environment file)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from server.service import launchd, systemd
from server.service.base import Context
from server.service.spec import ServiceSpec, absolute_paths, console_script, split_secrets

Validate = Callable[[list[str]], str | None]  # serve flags -> a problem, or None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-headroom service",
        allow_abbrev=False,
        description="Run mlx-headroom under launchd (macOS) or systemd (Linux). "
        "`install` takes the serve flags after its own, e.g. "
        "`mlx-headroom service install --model mlx-community/Qwen3-8B-4bit --port 8080`.",
    )
    parser.add_argument("action", choices=["install", "uninstall", "status", "logs"])
    parser.add_argument("--system", action="store_true",
                        help="a system service started at boot (LaunchDaemon / system unit); needs root")
    parser.add_argument("--run-as", help="the user a --system service runs as (default: $SUDO_USER)")
    parser.add_argument("--dry-run", action="store_true", help="print what would be written and run")
    parser.add_argument("--manager", choices=["launchd", "systemd"],
                        help="default: launchd on macOS, systemd elsewhere")
    parser.add_argument("--root", type=Path, default=Path("/"),
                        help="install a --system service under this directory instead of / "
                        "(for packaging and tests)")
    parser.add_argument("--domain",
                        help="launchd: the domain for install/uninstall/status (e.g. gui/501, "
                        "user/501; default: system with --system, else gui/<uid> when this user "
                        "has a GUI login session, user/<uid> otherwise)")
    parser.add_argument("-n", "--lines", type=int, default=200, help="logs: how many lines")
    parser.add_argument("-f", "--follow", action="store_true", help="logs: keep following")
    return parser


def _manager(name: str | None) -> ModuleType:
    if name is None:
        name = "launchd" if sys.platform == "darwin" else "systemd"
    return launchd if name == "launchd" else systemd


def main(argv: Sequence[str], *, validate: Validate | None = None) -> int:
    args, serve_argv = _parser().parse_known_args(list(argv))
    manager = _manager(args.manager)
    ctx = Context(home=Path(os.environ.get("HOME") or Path.home()), root=args.root,
                  system=args.system, dry_run=args.dry_run, domain=args.domain)
    if args.action != "install" and serve_argv:
        print(f"mlx-headroom service {args.action}: unexpected arguments {' '.join(serve_argv)}",
              file=sys.stderr)
        return 2
    if args.system and not args.dry_run and args.action in ("install", "uninstall") and os.geteuid() != 0:
        print("mlx-headroom service: --system needs root (run it with sudo)", file=sys.stderr)
        return 2
    try:
        if args.action == "install":
            return _install(manager, ctx, args, serve_argv, validate)
        if args.action == "uninstall":
            return int(manager.uninstall(ctx))
        if args.action == "status":
            return int(manager.status(ctx))
        return int(manager.logs(ctx, args.lines, args.follow))
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"mlx-headroom service {args.action}: {exc}", file=sys.stderr)
        return 1


def _install(manager: ModuleType, ctx: Context, args: argparse.Namespace, serve_argv: list[str],
             validate: Validate | None) -> int:
    if any(a == "--env-file" or a.startswith("--env-file=") for a in serve_argv):
        raise ValueError("--env-file is the service's own; give the keys as --api-key/--admin-key")
    paths = manager.paths(ctx)
    own = manager.service_args(paths)
    for flag in own[::2]:
        if any(a == flag or a.startswith(flag + "=") for a in serve_argv):
            raise ValueError(f"{flag} is the service's own ({' '.join(own)})")
    if validate is not None and (problem := validate(serve_argv)) is not None:
        print(f"mlx-headroom service install: {problem}", file=sys.stderr)
        return 2
    rest, secrets = split_secrets(absolute_paths(serve_argv))
    run_as = (args.run_as or os.environ.get("SUDO_USER")) if ctx.system else None
    spec = ServiceSpec(
        program=console_script(),
        serve_args=tuple(rest),
        env_file=paths.env_file,
        secrets=secrets,
        system=ctx.system,
        run_as=run_as or None,
        log_dir=paths.log_dir,
        service_args=tuple(own),
    )
    return int(manager.install(ctx, spec))
