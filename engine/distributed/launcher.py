"""`serve --tensor-parallel N`: start the ranks with MLX's launcher, and be one of them.

The command a user runs does not load a model: it runs `mlx.launch` (ring over 127.0.0.1
or NCCL on one host; ring or JACCL across the machines of a `--hostfile`), which starts
the same `serve` command once per rank with `MLX_RANK` set. `mlx.launch` terminates the
other ranks when one exits non-zero, but itself always exits 0, so this process reads its
"Node with rank N exited with code C" / "was killed" lines and exits non-zero when any
rank failed, for a service manager to restart the group.

Signals: the launcher runs in its own session with SIGTERM and SIGINT ignored, so a
Ctrl-C or a service stop reaches the ranks only as the SIGTERM this process forwards to
that session; rank 0 then drains like a single server and tells the others to stop.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.core import EngineConfig
    from engine.distributed.config import GroupConfig
    from engine.distributed.rank import Rank
    from memory import MemoryGuard, Probe

RANK_FAILED = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
EXIT_RANK_FAILED = 1
FAILED_GRACE_S = 10.0  # after a rank failed: how long the others get to end before SIGKILL
STOP_GRACE_S = 30.0  # after SIGTERM: beyond the drain, how long the ranks get to stop
# Never put a key on a command line (remote ranks would see it in `ps`): pass keys to rank
# 0 with --env-file on its machine.
SECRET = re.compile(r"KEY|SECRET|TOKEN|PASSWORD", re.IGNORECASE)
# mlx.launch relays each rank's output in a loop that `select`s on the rank's stdin pipe too
# (always writable) and on its own stdin (at end of file, always readable), so an idle group
# kept more than a core busy in the launcher alone (6.1 CPU-seconds in 5 s on a 2-core VM).
# Nothing is ever sent to a rank's stdin and the launcher's own is /dev/null: its `select`
# watches only the ranks' output, and otherwise sleeps out its timeout.
_LAUNCH = ("import select, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
           "signal.signal(signal.SIGINT, signal.SIG_IGN); "
           "import mlx._distributed_utils.launch as launch; "
           "launch.select = lambda r, w, x, t=None: select.select([f for f in r if f != 0], [], x, t); "
           "launch.main()")


def is_rank() -> bool:
    """True in a process `mlx.launch` started (it sets MLX_RANK for every backend)."""
    return "MLX_RANK" in os.environ


def resolve_backend(group: GroupConfig) -> str:
    if group.backend != "auto":
        return group.backend
    import mlx.core as mx

    return "nccl" if mx.cuda.is_available() else "ring"


def launch_command(group: GroupConfig, argv: list[str]) -> list[str]:
    backend = resolve_backend(group)
    cmd = [sys.executable, "-c", _LAUNCH, "--backend", backend]
    if group.hostfile:
        cmd += ["--hostfile", group.hostfile]
    else:
        cmd += ["--hosts", "127.0.0.1", "--repeat-hosts", str(group.ranks)]
    if backend == "nccl":
        cmd += ["--nccl-port", str(group.port)]
    else:
        cmd += ["--starting-port", str(group.port)]
    for name, value in sorted(os.environ.items()):
        if name.startswith("MLX_HEADROOM_") and not SECRET.search(name):
            cmd += ["--env", f"{name}={value}"]
    return [*cmd, "--", sys.executable, "-m", "server.cli", *argv]


def launch(group: GroupConfig, argv: list[str]) -> int:
    """Run the group; 0 when every rank ended cleanly, else non-zero."""
    proc = subprocess.Popen(launch_command(group, argv), stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    failed: list[str] = []

    def kill_later(delay_s: float) -> None:
        # `mlx.launch` waits for every rank it terminates; a rank that hangs (stopped, or
        # stuck in a driver call) would keep it, and us, waiting forever. SIGKILL ends
        # even a stopped process, and, through ssh's hang-up, a remote one.
        def kill() -> None:
            if proc.poll() is None:
                print(f"mlx-headroom: ranks still running {delay_s:.0f}s after the group ended; "
                      "killing them", file=sys.stderr, flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(delay_s, kill)
        timer.daemon = True
        timer.start()

    def relay() -> None:
        assert proc.stderr is not None
        for raw in iter(proc.stderr.readline, b""):
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
            if (m := RANK_FAILED.search(raw.decode(errors="replace"))) is not None:
                if not failed:
                    kill_later(FAILED_GRACE_S)
                failed.append(m.group(0))

    reader = threading.Thread(target=relay, name="mlx-launch-stderr", daemon=True)
    reader.start()

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        kill_later(group.shutdown_grace_s + STOP_GRACE_S)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = proc.wait()
    reader.join(timeout=5)
    if failed or code != 0:
        why = "; ".join(failed) or f"launcher exit {code}"
        print(f"mlx-headroom: the tensor-parallel group failed ({why})", file=sys.stderr, flush=True)
        return EXIT_RANK_FAILED
    return 0


def join_group(group: GroupConfig, config: EngineConfig, make_guard: Callable[[Probe], MemoryGuard]) -> Rank:
    from engine.distributed.rank import Rank

    return Rank(group, resolve_backend(group), config=config, make_guard=make_guard)
