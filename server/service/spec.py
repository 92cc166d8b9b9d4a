"""What a service runs, independent of the supervisor: the command, its secrets, its files.

`mlx-headroom service install [serve flags]` turns the serve flags into a `ServiceSpec`:
the absolute path of the installed console script, `serve`, `--env-file FILE`, and the
flags, minus the keys. Keys go into FILE (mode 0600), which the server reads at start, so
they never appear in a plist, a unit file, `ps` or `launchctl print`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

NAME = "mlx-headroom"
LABEL = "com.mlx-headroom.server"  # the launchd label
UNIT = "mlx-headroom.service"  # the systemd unit

# serve flags whose values are secrets: they move to the environment file.
SECRET_FLAGS = {"--api-key": "MLX_HEADROOM_API_KEY", "--admin-key": "MLX_HEADROOM_ADMIN_KEY"}


@dataclass(frozen=True)
class ServiceSpec:
    """One service as both supervisors need it. Paths are absolute."""

    program: tuple[str, ...]  # the console script (or python -m server.cli)
    serve_args: tuple[str, ...]  # the serve flags, without secrets
    env_file: Path
    secrets: dict[str, str] = field(default_factory=dict)  # written to env_file, 0600
    system: bool = False
    run_as: str | None = None  # the user a system service runs as (None: root)
    log_dir: Path | None = None  # launchd only: journald keeps systemd's logs
    service_args: tuple[str, ...] = ()  # the supervisor's own serve flags (launchd: the log)

    @property
    def arguments(self) -> list[str]:
        return [*self.program, "serve", "--env-file", str(self.env_file), *self.service_args,
                *self.serve_args]

    def env_text(self) -> str:
        lines = [f"{key}={_env_quote(value)}" for key, value in sorted(self.secrets.items())]
        return "# mlx-headroom service environment (secrets: keep this file 0600)\n" + "".join(
            line + "\n" for line in lines
        )


def _env_quote(value: str) -> str:
    """Quote for both dotenv (what the server reads) and systemd's EnvironmentFile."""
    if value and all(c.isalnum() or c in "-_.:/+=@" for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def console_script() -> tuple[str, ...]:
    """The installed `mlx-headroom` beside this interpreter, by absolute path (a service has
    no PATH worth relying on); `python -m server.cli` when there is none (a source tree)."""
    candidate = Path(os.path.abspath(sys.executable)).parent / NAME
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return (str(candidate),)
    return (os.path.abspath(sys.executable), "-m", "server.cli")


def split_secrets(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Take `--api-key K`, `--api-key=K` (and the admin key) out of the serve flags."""
    rest: list[str] = []
    secrets: dict[str, str] = {}
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in SECRET_FLAGS:
            if not eq:
                value = next(it, "")
            if not value:
                raise ValueError(f"{flag} needs a value")
            secrets[SECRET_FLAGS[flag]] = value
        else:
            rest.append(arg)
    return rest, secrets


PATH_FLAGS = ("--model",)  # values that may be local paths


def absolute_paths(argv: Sequence[str], cwd: Path | None = None) -> list[str]:
    """A service starts in its own directory: make a relative `--model ./dir` that exists
    here absolute, so it still names the same directory there (hub ids are left alone)."""
    base = cwd or Path.cwd()
    out = list(argv)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag not in PATH_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(out):
                continue
            value = out[i + 1]
        if value and not os.path.isabs(value) and (base / value).exists():
            absolute = str((base / value).resolve())
            if eq:
                out[i] = f"{flag}={absolute}"
            else:
                out[i + 1] = absolute
    return out


def health_url(serve_args: Sequence[str]) -> str:
    """Where the installed server answers /health, from its serve flags."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    known, _ = parser.parse_known_args(list(serve_args))
    host = known.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{known.port}/health"
