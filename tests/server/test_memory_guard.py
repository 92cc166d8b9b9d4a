"""Admission through a real server: 507s, eviction, waiting, runtime switches, accounting.

A small machine is simulated by injecting a probe (`--memory-probe allocator`: usage is
MLX's own allocator count, so it is exact) and a custom ceiling set just above it.
The tiny model holds 2 KiB of KV per token (4 layers × 2 KV heads × 32 dims × 2 × fp32).
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.conftest import ALLOCATOR, wait_until

MODEL = "mlx-headroom/tiny-chat"
KV_PER_TOKEN = 2048
MiB = 1 << 20


def reservation(tokens: int) -> int:
    """What admission commits for a lone request: KV in 256-token steps, plus one layer."""
    slots = -(-tokens // 256) * 256
    return slots * KV_PER_TOKEN * 5 // 4


def mem(url: str) -> dict:
    return httpx.get(f"{url}/v1/memory").json()


def guard(url: str, **body) -> httpx.Response:
    return httpx.put(f"{url}/v1/memory-guard", json=body)


def live_bytes(url: str) -> int:
    """Usage less MLX's buffer cache, which the guard has handed back before it refuses."""
    m = mem(url)
    return m["usage_bytes"] - m["allocator"]["cache_bytes"]


def set_ceiling_above_usage(url: str, extra: int) -> int:
    ceiling = live_bytes(url) + extra
    r = guard(url, enabled=True, tier="custom", ceiling_bytes=ceiling)
    assert r.status_code == 200, r.text
    return ceiling


def complete(url: str, prompt: str, max_tokens: int = 1, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, **extra})


def decisions_since(url: str, since: float) -> list[dict]:
    """The guard's decisions from `since` (time.time()) on: a shared server keeps earlier
    tests' decisions too."""
    return [d for d in mem(url)["decisions"] if d["at"] >= since]


def idle(url: str) -> bool:
    q = mem(url)["queue"]
    return q["waiting"] + q["prefilling"] + q["running"] == 0


class StreamInBackground:
    """Consume a streaming completion on a thread; `started` is set at its first chunk."""

    def __init__(self, url: str, prompt: str, max_tokens: int) -> None:
        self.started = threading.Event()
        self.text = ""
        self.finish: str | None = None
        self.status: int | None = None
        self.finished_at = 0.0
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        import json

        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    self.text += choice["text"]
                    self.finish = choice["finish_reason"] or self.finish
                    self.started.set()
        self.finished_at = time.monotonic()
        self.started.set()

    def join(self) -> None:
        self.thread.join(120)


def assert_507(r: httpx.Response, code: str | None = None) -> dict:
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["type"] == "insufficient_memory"
    assert err["param"] is None
    assert err["estimated_bytes"] > err["limit_bytes"] > 0
    assert err["binding"]
    assert "GiB" in err["message"] or "MiB" in err["message"] or "KiB" in err["message"]
    if code:
        assert err["code"] == code
    return err


def test_never_fits_is_507_fast_while_a_stream_finishes(small_machine):
    proc = small_machine
    since = time.time()
    reference = complete(proc.url, "hello there", max_tokens=300).json()["choices"][0]["text"]
    stream = StreamInBackground(proc.url, "hello there", 300)
    assert stream.started.wait(60)
    set_ceiling_above_usage(proc.url, 4 * MiB)
    started = time.monotonic()
    big = complete(proc.url, "x" * 3000, max_tokens=10)
    elapsed = time.monotonic() - started
    err = assert_507(big)
    assert err["code"] in {"prefill_memory_exceeded", "prompt_exceeds_memory_ceiling"}
    assert err["binding"] == "custom"
    assert big.headers["x-should-retry"] == "false"
    assert "retry-after" not in big.headers
    assert elapsed < 5
    stream.join()
    assert stream.status == 200
    assert stream.finish == "length"
    assert stream.text == reference
    assert "reject" in [d["outcome"] for d in decisions_since(proc.url, since)]


def test_refused_stream_gets_a_real_507_status(small_machine):
    proc = small_machine
    set_ceiling_above_usage(proc.url, 2 * MiB)
    r = httpx.post(f"{proc.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "stream": True, "max_tokens": 10,
        "messages": [{"role": "user", "content": "y" * 3000}]})
    assert_507(r)
    assert not r.headers["content-type"].startswith("text/event-stream")


def preflight_prediction(url: str, response: httpx.Response) -> int:
    """The bytes admission predicted for a request, read from the decision log."""
    request_id = response.json()["id"].split("-", 1)[1] + "-0"
    return next(d["predicted_bytes"] for d in mem(url)["decisions"]
                if d["request_id"] == request_id)


def test_eviction_is_lru_and_spares_the_entry_about_to_be_hit(start_server):
    proc = start_server(args=[*ALLOCATOR, "--prefill-step-size", "4096"])
    prompts = {name: name * 2000 for name in "abc"}
    for prompt in prompts.values():
        assert complete(proc.url, prompt).status_code == 200
    entry = mem(proc.url)["prefix_cache"]["bytes"] // 3
    # A twin of the request below (same shape, hitting c) tells what such a request is
    # predicted to need. LRU order afterwards: a, b, c, twin.
    twin = complete(proc.url, prompts["c"][:1500] + "zzzzzzzzzz")
    assert twin.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 1500
    needed = preflight_prediction(proc.url, twin)
    before = mem(proc.url)["prefix_cache"]
    # d hits a, the least recently used entry, which becomes protected; with the ceiling a
    # quarter of an entry short, exactly one entry must go: b, the next least recent.
    set_ceiling_above_usage(proc.url, needed - entry // 4)
    d = complete(proc.url, prompts["a"][:1500] + "zzzzzzzzzz")
    assert d.status_code == 200, d.text
    assert d.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 1500
    after = mem(proc.url)
    block = 16 * KV_PER_TOKEN  # evictions count blocks: b's, one entry's
    assert after["prefix_cache"]["evictions_by_cause"]["admission"] == \
        before["evictions_by_cause"]["admission"] + entry // block
    evict = [x for x in after["decisions"] if x["outcome"] == "evict"]
    assert evict and 0 < evict[-1]["bytes_to_free"] <= entry
    assert guard(proc.url, tier="balanced").status_code == 200
    hit_c = complete(proc.url, prompts["c"][:1500] + "yyyy")
    hit_b = complete(proc.url, prompts["b"][:1500] + "yyyy")
    assert hit_c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 1500
    assert hit_b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _two_requests_that_fit_one_at_a_time(proc) -> tuple[StreamInBackground, httpx.Response]:
    # Each needs reservation(~1520) = 3.75 MiB; the ceiling leaves room for one and a half.
    # Mostly prompt (one prefill chunk): the first holds its memory for 500 decode steps.
    set_ceiling_above_usage(proc.url, reservation(1520) * 3 // 2 + MiB)
    first = StreamInBackground(proc.url, "f" * 1000, 500)
    assert first.started.wait(60)
    second = complete(proc.url, "s" * 1000, max_tokens=500)
    return first, second


def test_request_waits_for_memory_then_succeeds(small_machine):
    proc = small_machine  # waits for memory up to 120 s
    since = time.time()
    first, second = _two_requests_that_fit_one_at_a_time(proc)
    done_at = time.monotonic()
    first.join()
    assert second.status_code == 200, second.text
    assert second.json()["usage"]["completion_tokens"] == 500
    assert first.finish == "length" and first.finished_at <= done_at
    assert any(d["outcome"] == "wait" for d in decisions_since(proc.url, since))


def test_wait_that_times_out_is_507_with_retry_after(small_machine_short_wait):
    proc = small_machine_short_wait
    first, second = _two_requests_that_fit_one_at_a_time(proc)
    err = assert_507(second, "memory_wait_timeout")
    assert int(second.headers["retry-after"]) >= 1
    assert second.headers["x-should-retry"] == "true"
    assert "Waited" in err["message"]
    first.join()
    assert first.finish == "length"


def test_guard_switches_at_runtime(small_machine):
    proc = small_machine
    assert guard(proc.url).json() == {"enabled": True, "tier": "balanced", "ceiling_bytes": None}
    set_ceiling_above_usage(proc.url, 1 * MiB)
    assert_507(complete(proc.url, "z" * 2000))
    off = guard(proc.url, enabled=False).json()
    assert off["enabled"] is False and off["tier"] == "custom"
    assert complete(proc.url, "z" * 2000).status_code == 200
    assert guard(proc.url, enabled=True).status_code == 200
    assert_507(complete(proc.url, "w" * 2000))
    assert guard(proc.url, tier="balanced").json()["tier"] == "balanced"
    assert complete(proc.url, "w" * 2000).status_code == 200
    assert httpx.get(f"{proc.url}/v1/memory-guard").json()["tier"] == "balanced"


@pytest.mark.parametrize("body", [
    {"tier": "bogus"},
    {"ceiling_bytes": -5},
    {"tier": "custom"},
    {"enabled": "sometimes"},
    {"unknown": 1},
])
def test_guard_rejects_invalid_updates(server, body):
    r = httpx.put(f"{server.url}/v1/memory-guard", json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/v1/memory-guard").json()["tier"] == "balanced"


def test_prefill_chunk_shrinks_under_pressure_instead_of_refusing(start_server):
    proc = start_server(args=[*ALLOCATOR, "--prefill-step-size", "2048"])
    # A 2048-token chunk materialises a 64 MiB score matrix on the CPU; 24 MiB of room
    # above the request's KV admits only smaller chunks.
    before = mem(proc.url)["engine"]["prefill_chunks"]
    set_ceiling_above_usage(proc.url, reservation(3011) + 24 * MiB)
    r = complete(proc.url, "q" * 3000, max_tokens=10)
    assert r.status_code == 200, r.text
    chunks = mem(proc.url)["engine"]["prefill_chunks"] - before
    assert chunks > 2  # 2048 + 951 without shrinking


def test_committed_bytes_return_to_zero_and_decode_stays_within_reservation(small_machine):
    proc = small_machine
    weights = live_bytes(proc.url)
    streams = [StreamInBackground(proc.url, f"request {i}", 400) for i in range(3)]
    for s in streams:
        assert s.started.wait(60)
    samples = []
    while any(s.thread.is_alive() for s in streams):
        m = mem(proc.url)
        if m["queue"]["running"]:
            samples.append(m)
    for s in streams:
        s.join()
        assert s.finish == "length"
    assert samples
    for m in samples:
        allowed = weights + m["committed_bytes"] + m["prefix_cache"]["bytes"] + MiB
        assert m["allocator"]["active_bytes"] <= allowed
    wait_until(lambda: idle(proc.url))
    assert mem(proc.url)["committed_bytes"] == 0
    # cancelled requests release their reservation too
    with httpx.stream("POST", f"{proc.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "cancel me", "max_tokens": 6000, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert mem(proc.url)["committed_bytes"] > 0
                break
    wait_until(lambda: idle(proc.url))
    m = mem(proc.url)
    assert m["committed_bytes"] == 0 and m["kv_bytes"] == 0


@pytest.mark.slow  # an overload: eight prompts where three fit
def test_more_long_prompts_than_fit_all_complete(start_server):
    """Prompts that each fit alone but not together are all answered, none refused: they
    take turns (waiting, and preempting a queued prefill when nothing else would free
    memory) instead of deadlocking or failing."""
    proc = start_server(args=[*ALLOCATOR, "--prefill-step-size", "256"],
                        env={"MLX_HEADROOM_MEMORY_WAIT_TIMEOUT_S": "120"})
    set_ceiling_above_usage(proc.url, 3 * reservation(1204) + 12 * MiB)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=proc.url, timeout=120) as client:
            return await asyncio.gather(*[
                client.post("/v1/completions", json={
                    "model": MODEL, "prompt": chr(ord("A") + i) * 1200, "max_tokens": 4,
                    "temperature": 0})
                for i in range(8)
            ])

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)
    m = mem(proc.url)
    assert m["engine"]["max_batch"] < 8  # they did not all fit at once
    wait_until(lambda: idle(proc.url))
    assert mem(proc.url)["committed_bytes"] == 0
