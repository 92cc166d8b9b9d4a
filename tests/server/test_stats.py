"""`GET /v1/stats` and the history ring behind the dashboard, through a real server."""

from __future__ import annotations

import itertools

import httpx
import pytest

from server.history import History, Sample
from server.stats import _percentiles
from tests.conftest import wait_until

MODEL = "mlx-headroom/tiny-chat"


@pytest.fixture
def srv(small_machine):
    """The shared allocator-probe server: the tests count what they add to its figures."""
    return small_machine


def stats(url: str, **params: float) -> dict:
    r = httpx.get(url + "/v1/stats", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, content: str = "hello there", max_tokens: int = 6) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})


@pytest.mark.parametrize(
    ("values", "p50", "p95"),
    [([], None, None), ([0.2], 0.2, 0.2), ([0.1, 0.2, 0.3, 0.4], 0.2, 0.4),
     ([float(i) for i in range(1, 101)], 50.0, 95.0)],
)
def test_percentiles_nearest_rank(values, p50, p95):
    assert _percentiles(values) == {"p50": p50, "p95": p95}


def test_the_ring_is_bounded_and_answers_since():
    clock = iter(range(100))
    ring = History(lambda: Sample(float(next(clock)), 1, 0, 10, True, 0, 0, 0, 0), size=5)
    for _ in range(8):
        ring.take()
    assert [s.at for s in ring.since()] == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert [s.at for s in ring.since(5.0)] == [6.0, 7.0]
    assert ring.at_or_before(4.5).at == 4.0 and ring.at_or_before(1.0) is None


def test_a_sampler_that_wakes_early_skips_to_the_next_boundary() -> None:
    ring = History(lambda: None, period_s=1.0)  # type: ignore[arg-type, return-value]
    assert ring.next_due(10.2) == 11.0
    assert ring.next_due(10.998) == 12.0  # woke 2 ms before 11: not a second sample at 11.0
    assert ring.next_due(11.0) == 12.0


def test_history_is_sampled_once_a_second(srv):
    since = stats(srv.url)["history"]["at"][-1]
    wait_until(lambda: len(stats(srv.url, since=since)["history"]["at"]) >= 4, timeout=15)
    h = stats(srv.url)["history"]
    at = [t for t in h["at"] if t > since]  # samples this test waited for
    gaps = [b - a for a, b in itertools.pairwise(at)]
    assert all(0.5 <= g <= 1.6 for g in gaps), gaps
    assert len(h["usage_bytes"]) == len(h["ceiling_bytes"]) == len(h["committed_bytes"]) == len(h["at"])
    assert all(u > 0 for u in h["usage_bytes"]) and all(c > 0 for c in h["ceiling_bytes"])
    newer = stats(srv.url, since=h["at"][-2])["history"]["at"]
    assert newer and newer[0] == h["at"][-1]


def test_throughput_latency_and_chunks_come_from_served_requests(srv):
    before = stats(srv.url)
    for _ in range(3):
        assert chat(srv.url).status_code == 200
    s = stats(srv.url)
    assert s["throughput"]["generated_tokens"] - before["throughput"]["generated_tokens"] == 18
    wait_until(lambda: stats(srv.url)["throughput"]["generated_tokens_per_s"] > 0, timeout=5)
    lat = s["latency"]
    assert lat["requests"] - before["latency"]["requests"] == 3
    assert 0 < lat["ttft_s"]["p50"] <= lat["ttft_s"]["p95"]
    assert 0 < lat["tpot_s"]["p50"] <= lat["tpot_s"]["p95"]
    assert s["in_flight"] == {"waiting": 0, "prefilling": 0, "running": 0, "total": 0}
    chunk = s["chunks"]["recent"][0]
    assert chunk["tokens"] > 0 and chunk["predicted_bytes"] > 0 and chunk["measured_bytes"] > 0
    assert s["chunks"]["ewma_bytes_per_token"] > 0


def test_refusals_are_counted_and_explained(srv):
    url = srv.url
    usage = httpx.get(url + "/v1/memory").json()["usage_bytes"]
    before = stats(url)["refusals"]
    assert httpx.put(url + "/v1/memory-guard", json={"ceiling_bytes": usage + (256 << 10)}).status_code == 200
    try:
        r = chat(url, "tell me a long story " * 100)
        assert r.status_code == 507, r.text
    finally:
        httpx.put(url + "/v1/memory-guard", json={"tier": "balanced"})
    after = stats(url)["refusals"]
    assert after["since_start"]["reject"] == before["since_start"]["reject"] + 1
    assert after["last_5_min"]["reject"] == before["last_5_min"]["reject"] + 1
    assert after["last_minute"] >= 1
    latest = after["latest_reject"]
    assert latest["binding"] == "custom" and latest["limit_bytes"] == usage + (256 << 10)
    assert latest["over_bytes"] == latest["needed_bytes"] - latest["limit_bytes"] > 0
    assert r.json()["error"]["limit_bytes"] == latest["limit_bytes"]
    assert after["recent"][0] == latest


def test_an_idle_engine_takes_no_steps(srv):
    assert chat(srv.url).status_code == 200
    steps = httpx.get(srv.url + "/v1/memory").json()["engine"]["steps"]
    start = stats(srv.url)["history"]["at"][-1]
    # three samples later (about 3 s), with nothing to do, the engine has stepped no further
    wait_until(lambda: len(stats(srv.url, since=start)["history"]["at"]) >= 3, timeout=10)
    assert httpx.get(srv.url + "/v1/memory").json()["engine"]["steps"] == steps
