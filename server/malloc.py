"""Serve on jemalloc where a Linux machine has it: the host's share of a decode step is
allocation.

MLX builds every step as a graph of a few thousand small C++ objects (arrays, their
shared pointers, CUDA graph nodes) and frees them a step later; glibc's malloc pays for
that in consolidation, in whichever call next asks for a larger block. With jemalloc
preloaded, the engine thread's CPU per decode step fell by about 36 % on the CPU backend
(a 32-layer model at batch 1: 15.1–16.0 against 9.4–10.8 ms, and 13 % more tokens per
second through the server; docs/throughput.md). On the H200 it cut the
engine's batch-1 step from 6.23 to 5.28 ms, with 25 % less time inside `mx.async_eval`
(medians of five fresh processes each).

The allocator cannot change inside a running process, so `serve` re-executes itself once,
the same process id and arguments, with the library in `LD_PRELOAD`. `--malloc system`
(`MLX_HEADROOM_MALLOC=system`) keeps the C library's. Nothing happens on macOS, where the
system allocator is not glibc's and `DYLD_INSERT_LIBRARIES` is not for services, nor
where no jemalloc is installed (Debian and Ubuntu: `libjemalloc2`).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

LIBRARY = "libjemalloc.so.2"
OPENBLAS = "libopenblas.so.0"
SEARCH_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
               "/usr/local/lib")
CHOSEN = "MLX_HEADROOM_MALLOC_CHOSEN"  # set on the re-executed process, so it happens once


def find_jemalloc(dirs: tuple[str, ...] = SEARCH_DIRS) -> str | None:
    return _find(LIBRARY, dirs)


def _find(name: str, dirs: tuple[str, ...] = SEARCH_DIRS) -> str | None:
    for d in dirs:
        path = Path(d, name)
        if path.exists():
            return str(path)
    return None


@functools.cache
def running_allocator() -> str:
    """"jemalloc" when this process has it mapped, else "system". Read once: a process's
    allocator is fixed from its start, and its memory map runs to thousands of lines."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "jemalloc" if "libjemalloc" in maps else "system"


def reexec_env(choice: str, environ: dict[str, str], platform: str = sys.platform,
               library: str | None = None) -> dict[str, str] | None:
    """The environment to re-execute with, or None to go on as we are."""
    if choice != "auto" or not platform.startswith("linux") or environ.get(CHOSEN):
        return None
    if "libjemalloc" in environ.get("LD_PRELOAD", ""):
        return None
    library = library or find_jemalloc()
    if library is None:
        return None
    preload = " ".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    return {**environ, "LD_PRELOAD": preload, CHOSEN: "1"}


def early_choice(argv: list[str], environ: dict[str, str]) -> str:
    """The `--malloc` choice from the command line or the environment, read before anything
    else is imported: a re-execution after the settings are parsed cost 1.1 s of start-up.
    An env file's choice is honoured later (`leave_jemalloc`)."""
    for i, arg in enumerate(argv):
        if arg == "--malloc" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--malloc="):
            return arg.partition("=")[2]
    return environ.get("MLX_HEADROOM_MALLOC", "auto").lower()


def leave_jemalloc(choice: str) -> None:
    """The parsed settings say `system` where the early choice preloaded jemalloc (an env
    file's MALLOC=system): re-execute once more without it."""
    if choice != "system" or os.environ.get(CHOSEN) != "1":
        return
    kept = " ".join(p for p in os.environ.get("LD_PRELOAD", "").split() if "libjemalloc" not in p)
    _reexec({**os.environ, "LD_PRELOAD": kept, CHOSEN: "system"})


def with_openblas(environ: dict[str, str], platform: str = sys.platform,
                  library: str | None = None) -> dict[str, str] | None:
    """`environ` with Debian's OpenBLAS preloaded, or None where it is preloaded already, not
    installed (`libopenblas0-pthread`), not Linux, or turned off (`MLX_HEADROOM_OPENBLAS=0`).

    MLX's Linux CPU wheel links a reference BLAS: float32 matmuls at 2-4 GFLOP/s, where the
    same wheel with OpenBLAS preloaded runs 55-127 (a prompt's prefill and every step of the
    CPU backend; on CUDA the matmuls are the GPU's and the preload costs nothing)."""
    if not platform.startswith("linux") or environ.get("MLX_HEADROOM_OPENBLAS", "1") == "0":
        return None
    if "libopenblas" in environ.get("LD_PRELOAD", ""):
        return None
    library = library or _find(OPENBLAS)
    if library is None:
        return None
    preload = " ".join(p for p in (environ.get("LD_PRELOAD", ""), library) if p)
    return {**environ, "LD_PRELOAD": preload}


def serve_on_jemalloc(choice: str) -> None:
    """Re-execute this process on jemalloc if `choice` is "auto" and the machine has it, and
    with OpenBLAS where it is installed (`with_openblas`); returns only when neither applies."""
    env = reexec_env(choice, dict(os.environ))
    if env is not None and running_allocator() == "jemalloc":
        env = None
    blas = with_openblas(env or dict(os.environ))
    if blas is not None:
        env = blas
    if env is None:
        return
    _reexec(env)


def _reexec(env: dict[str, str]) -> None:
    """This process again, same pid and command line, in `env`."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
