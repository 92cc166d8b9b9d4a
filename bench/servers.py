"""Server processes under test, and what the harness watches while a scenario runs.

`Server` starts a command, waits for `/health`, and stops it with SIGTERM (then SIGKILL).
`Watch` samples `/health` (and, for ours, `/v1/memory`; on CUDA machines `nvidia-smi`; always
the process's resident set) every `interval_s` while a scenario runs, and summarises: health
failures, whether the process survived, peak memory. `GpuBusy` reads the driver's utilisation
(NVML) over a stretch of work: near 100 % the device sets the pace, well below it the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_STARTED: list[Server] = []


def stop_all() -> None:
    """Stop every server this process started that is still running (on exit or SIGTERM)."""
    for server in _STARTED:
        server.stop(timeout_s=10.0)


@dataclass
class Server:
    name: str  # "ours" | "mlx_lm"
    args: list[str]  # after `python -m`
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    started_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.port}.log"

    def start(self, timeout_s: float = 600.0) -> Server:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", *self.args, "--port", str(self.port)]
        began = time.monotonic()
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **self.env}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        _STARTED.append(self)
        while time.monotonic() - began < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.started_s = time.monotonic() - began
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f}s:\n{self.tail()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only its children
                self.proc.wait()
        return self.proc.returncode


def _rss(pid: int) -> int | None:
    try:
        import psutil

        proc = psutil.Process(pid)
        return int(proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(True)))
    except Exception:  # psutil missing, or the process is gone
        return None


async def _nvidia_smi_used() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    proc = await asyncio.create_subprocess_exec(
        "nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await proc.communicate()
    try:
        return sum(int(x) for x in out.decode().split()) * (1 << 20)  # MiB, summed over GPUs
    except ValueError:
        return None


class Periodic:
    """A task that samples every `interval_s` seconds while a benchmark runs: subclasses say
    what one sample is (`tick`); one HTTP client for the whole run, each sleep shortened by the
    time the sample itself took."""

    interval_s: float = 1.0
    min_sleep_s: float = 0.0  # the least pause between samples
    _task: asyncio.Task[None] | None = None

    async def tick(self, client: httpx.AsyncClient) -> None:
        raise NotImplementedError

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient()

    async def _loop(self) -> None:
        async with self.client() as client:
            while True:
                started = time.monotonic()
                await self.tick(client)
                await asyncio.sleep(max(self.min_sleep_s, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def __aenter__(self) -> Periodic:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class GpuBusy:
    """How busy the GPU was while the block ran, as NVML counts it (`percent`; None without
    NVML: the CPU, Metal, or no nvidia-ml-py). NVML averages over its own sample period, so
    readings from the first `skip_s` are dropped, and the block should run a few seconds."""

    def __init__(self, period_s: float = 0.05, skip_s: float = 0.3) -> None:
        self.period_s = period_s
        self.skip_s = skip_s
        self.samples: list[int] = []
        self.percent: float | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml  # type: ignore[import-not-found, unused-ignore]

            from memory.probes.nvml import visible_device

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, visible_device(pynvml)
        except Exception:  # no package, no driver, no device: report None
            self._nvml = None

    def __enter__(self) -> GpuBusy:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.samples:
            self.percent = round(statistics.mean(self.samples), 1)

    def _poll(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(self.period_s):
            if time.perf_counter() - start >= self.skip_s:
                self.samples.append(int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))


class Watch(Periodic):
    """Samples a server while a scenario runs: `async with Watch(server) as w: ...; w.summary()`."""

    def __init__(self, server: Server, *, interval_s: float = 0.5, memory_view: bool = False) -> None:
        self.server = server
        self.interval_s = interval_s
        self.memory_view = memory_view
        self.health_ok = 0
        self.health_failed: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.last_memory: dict[str, Any] | None = None

    def _max(self, key: str, value: int | None) -> None:
        if value is not None:
            self.peak[key] = max(self.peak.get(key, 0), int(value))

    async def tick(self, client: httpx.AsyncClient) -> None:
        try:
            r = await client.get(self.server.url + "/health", timeout=2.0)
            if r.status_code == 200:
                self.health_ok += 1
            else:
                key = str(r.status_code)
                self.health_failed[key] = self.health_failed.get(key, 0) + 1
        except httpx.HTTPError as exc:
            key = type(exc).__name__
            self.health_failed[key] = self.health_failed.get(key, 0) + 1
        if self.memory_view:
            try:
                r = await client.get(self.server.url + "/v1/memory", headers=self.server.headers,
                                     timeout=2.0)
                if r.status_code == 200:
                    view = r.json()
                    self.last_memory = view
                    self._max("usage_bytes", view.get("usage_bytes"))
                    self._max("committed_bytes", view.get("committed_bytes"))
                    self._max("kv_bytes", view.get("kv_bytes"))
                    queue = view.get("queue") or {}
                    for k in ("waiting", "prefilling", "running"):
                        self._max(f"queue_{k}", queue.get(k))
            except (httpx.HTTPError, ValueError):
                pass
        if self.server.proc is not None:
            self._max("rss_bytes", _rss(self.server.proc.pid))
        self._max("gpu_used_bytes", await _nvidia_smi_used())

    def summary(self) -> dict[str, Any]:
        return {
            "health_samples": self.health_ok + sum(self.health_failed.values()),
            "health_failures": sum(self.health_failed.values()),
            "health_failures_by_kind": dict(self.health_failed),
            "alive_after": self.server.alive,
            "peak": dict(self.peak),
        }
