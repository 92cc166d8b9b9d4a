"""Through a server whose probe is injected:

- a memory probe that fails is an unknown, not a "no": requests wait and re-read, and are
  never refused with `x-should-retry: false`; the engine keeps serving;
- memory the footprint holds beyond what MLX counts (CUDA's pool) is handed back even
  while the engine is idle, at most once a second.

The server runs in this process (uvicorn on a thread) so that the probe can be injected:
the real allocator probe, made to raise while `failing` is set (as NVML does when the
driver hiccups), or to report `pool` bytes more than MLX counts until a hand-back.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from memory import AllocatorProbe, MemorySnapshot
from server.app import create_app
from server.settings import Settings
from tests.conftest import free_port, wait_until

MODEL = "mlx-headroom/tiny-chat"


class FlakyProbe:
    def __init__(self) -> None:
        self.inner = AllocatorProbe()
        self.failing = False
        self.failures = 0
        self.pool = 0  # bytes the "driver" counts beyond MLX's active + cache

    def read(self) -> MemorySnapshot:
        if self.failing:
            self.failures += 1
            raise OSError("NVML_ERROR_UNKNOWN: the driver did not answer")
        snap = self.inner.read()
        return dataclasses.replace(snap, footprint_bytes=snap.footprint_bytes + self.pool)


@pytest.fixture
def serve(tiny_model_path: Path) -> Iterator:
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(wait_timeout_s: float) -> tuple[str, FlakyProbe, object]:
        probe = FlakyProbe()
        settings = Settings(model=str(tiny_model_path), served_model_name=MODEL,
                            memory_wait_timeout_s=wait_timeout_s,
                            memory_probe_grace_s=0)  # no last reading standing in
        app = create_app(settings, probe=probe)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_until(lambda: server.started)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}", probe, app.state.server.guard

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(30)


def complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "hello there", "max_tokens": 5, "temperature": 0})


def test_a_failing_probe_makes_requests_wait_then_they_run(serve):
    url, probe, guard = serve(wait_timeout_s=60)
    probe.failing = True
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", complete(url)))
    thread.start()
    wait_until(lambda: any(d.code == "memory_probe_failed" for d in guard.recent_decisions()))
    assert httpx.get(f"{url}/v1/memory").status_code == 503  # said plainly, not a 500
    assert httpx.get(f"{url}/health").status_code == 200
    probe.failing = False
    thread.join(60)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert all(d.outcome.value != "reject" for d in guard.recent_decisions())


def test_a_probe_that_stays_down_is_a_503_that_says_retry(serve):
    url, probe, _ = serve(wait_timeout_s=0.3)
    probe.failing = True
    started = time.monotonic()
    r = complete(url)
    assert r.status_code == 503, r.text  # it waited for a reading, not for memory
    assert r.json()["error"]["code"] == "memory_probe_unavailable"
    assert r.headers["x-should-retry"] == "true" and int(r.headers["retry-after"]) >= 1
    assert "memory probe" in r.json()["error"]["message"]
    assert time.monotonic() - started < 30
    probe.failing = False
    assert complete(url).status_code == 200  # the engine lived through it


def test_memory_mlx_does_not_count_is_handed_back_while_idle(serve):
    url, probe, guard = serve(wait_timeout_s=30)
    assert guard.hand_backs == 0  # nothing untracked: nothing to hand back
    probe.pool = 1 << 30  # CUDA's pool grows by 1 GiB (more than the 256 MiB margin)
    wait_until(lambda: guard.hand_backs == 1, timeout=10)  # no request needed: upkeep
    assert httpx.get(f"{url}/v1/memory").json()["allocator"]["hand_backs"] == 1
    # What a hand-back leaves is not reclaimable: it is not asked for again and again.
    assert complete(url).status_code == 200
    assert guard.hand_backs == 1
    probe.pool = 2 << 30  # the pool grows again
    wait_until(lambda: guard.hand_backs == 2, timeout=10)
