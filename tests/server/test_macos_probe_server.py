"""A real server on the macOS probe, its libc replaced by a fake that replays the kernel's
failure modes (tests/fake_darwin.py). In each the engine keeps serving; when no reading is
left to trust, new work gets 503 "memory probe unavailable" with Retry-After, what is
already decoding finishes, and the server recovers with the probe."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import uvicorn

from memory.probes.macos import MIG_ARRAY_TOO_LARGE, MacOSProbe
from server.app import create_app
from server.settings import Settings
from tests.conftest import free_port, wait_until
from tests.fake_darwin import KERN_FAILURE, FakeDarwin

MODEL = "mlx-headroom/tiny-chat"
MESSAGES = [{"role": "user", "content": "hello there"}]
GRACE_S = 1.0
WAIT_S = 2.0  # how long new work waits for a reading before the 503


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


@pytest.fixture
def macos_server(tiny_model_path: Path) -> Iterator[Callable[[FakeDarwin], tuple[str, MacOSProbe]]]:
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(fake: FakeDarwin) -> tuple[str, MacOSProbe]:
        probe = MacOSProbe(libc=fake, recommended_working_set=lambda: None, vm_interval_s=0.0)
        settings = Settings(model=str(tiny_model_path), served_model_name=MODEL,
                            memory_probe_grace_s=GRACE_S, memory_wait_timeout_s=WAIT_S)
        port = free_port()
        app = create_app(settings, probe=probe)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        wait_until(lambda: server.started)
        return f"http://127.0.0.1:{port}", probe

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(30)


def chat(url: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra})


def serves(url: str, times: int = 3) -> None:
    for _ in range(times):
        r = chat(url)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/v1/memory").status_code == 200


def test_mig_array_too_large_then_success(macos_server):
    # macOS 27: after a few calls the cached 40-integer reply meets a count of 38 (-307).
    fake = FakeDarwin(kernel_count=40, mig_after=2, footprint=_rss)
    url, probe = macos_server(fake)
    serves(url)
    assert (38, MIG_ARRAY_TOO_LARGE) in fake.vm_calls and fake.vm_calls[-1] == (40, 0)
    assert probe.vm_failures == 0
    system = httpx.get(f"{url}/v1/memory").json()["system"]
    assert system["inactive_bytes"] == fake.inactive_pages * fake.page_size


def test_permanently_failing_vm_statistics(macos_server):
    fake = FakeDarwin(fail_rc=KERN_FAILURE, footprint=_rss)
    url, probe = macos_server(fake)
    serves(url)
    memory = httpx.get(f"{url}/v1/memory").json()
    # Conservative: nothing but free pages counts beside our own footprint.
    assert memory["system"]["inactive_bytes"] == 0 and memory["system"]["active_bytes"] == 0
    assert memory["system"]["free_bytes"] == (fake.free_pages + fake.speculative_pages) * fake.page_size
    assert probe.vm_failures > 3


def test_stale_counts(macos_server):
    fake = FakeDarwin(footprint=2 << 30)
    url, _ = macos_server(fake)
    serves(url, times=1)
    fake.rate_limited = True  # host_statistics64 repeats old counts from now on
    fake.allocate(3 << 30)
    serves(url)
    system = httpx.get(f"{url}/v1/memory").json()["system"]
    assert system["free_bytes"] == (fake.free_pages + fake.speculative_pages) * fake.page_size


def test_no_reading_at_all_is_503_with_retry_after_and_the_server_recovers(macos_server):
    fake = FakeDarwin(footprint=_rss)
    url, _ = macos_server(fake)
    serves(url, times=1)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 150, "stream": True}
    chunks = []
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if not chunks:
                        # The probe dies mid-stream (every syscall fails): decoding needs no
                        # admission and goes on; the last reading stands in for the grace, then new
                        # work waits for a reading, then gets 503.
                        fake.fail_rc, fake.fail_rusage, fake.sysctl_vm_counts = KERN_FAILURE, True, False
                        started = time.monotonic()
                        refused = chat(url)
                        while refused.status_code == 200:
                            assert time.monotonic() - started < GRACE_S + WAIT_S + 10
                            refused = chat(url)
                    chunks.append(json.loads(line[6:]))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content") is not None) > 1
    assert refused.status_code == 503, refused.text
    err = refused.json()["error"]
    assert err["code"] == "memory_probe_unavailable" and err["type"] == "service_unavailable"
    assert "memory probe unavailable" in err["message"]
    assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-should-retry"] == "true"
    memory = httpx.get(f"{url}/v1/memory")
    assert memory.status_code == 503 and memory.json()["error"]["code"] == "memory_probe_unavailable"
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["memory_probe"] == "unavailable"
    assert httpx.get(f"{url}/metrics").status_code == 200
    stats = httpx.get(f"{url}/v1/stats")  # the dashboard's poll: no numbers to show, say why
    assert stats.status_code == 503 and stats.json()["error"]["code"] == "memory_probe_unavailable"
    fake.fail_rc, fake.fail_rusage, fake.sysctl_vm_counts = None, False, True
    serves(url)
    assert httpx.get(f"{url}/health").json()["memory_probe"] == "ok"
