"""Memory truth through a real server: no false refusals after a burst, MLX's cache limit
follows the ceiling, and GET /v1/memory says where its numbers come from.

Memory pressure is simulated the usual way: `--memory-probe allocator` (usage is MLX's own
count, exact) and a custom ceiling set above the idle server's live bytes. The tiny model
holds 2 KiB of KV per token.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import wait_until
from tests.server.test_memory_guard import (
    ALLOCATOR,
    MiB,
    StreamInBackground,
    complete,
    guard,
    idle,
    live_bytes,
    mem,
)

MLX_CPU_DEFAULT_CACHE_LIMIT = 32 * MiB


@pytest.mark.slow  # an overload: a burst of eight, then a long prompt
def test_a_long_prompt_that_fits_alone_is_admitted_after_a_burst_not_refused(start_server):
    """A burst of short requests is finishing when a long prompt arrives. The long prompt
    fits the ceiling alone (about 15 MiB of its 48 MiB), so it must wait for the burst and
    run, never get a 507 that tells the client not to retry. Before the fix, admission
    judged it by what the busy server had left (there, a left-padded batch of 9 rows of the
    long prompt's length) and refused it for good."""
    proc = start_server(args=[*ALLOCATOR, "--max-concurrency", "16"],
                        env={"MLX_HEADROOM_MEMORY_WAIT_TIMEOUT_S": "120"})
    ceiling = live_bytes(proc.url) + 48 * MiB
    assert guard(proc.url, tier="custom", ceiling_bytes=ceiling).status_code == 200

    burst = [StreamInBackground(proc.url, f"burst {i}", 300) for i in range(8)]
    for s in burst:
        assert s.started.wait(60)
    long_prompt = complete(proc.url, "L" * 3000, max_tokens=4)
    for s in burst:
        s.join()
        assert (s.status, s.finish) == (200, "length")
    assert long_prompt.status_code == 200, long_prompt.text
    assert long_prompt.json()["usage"]["completion_tokens"] == 4

    request_id = long_prompt.json()["id"].split("-", 1)[1] + "-0"
    outcomes = [d["outcome"] for d in mem(proc.url)["decisions"] if d["request_id"] == request_id]
    assert outcomes and "reject" not in outcomes, outcomes

    # And once the burst has gone, another long prompt goes straight through.
    wait_until(lambda: idle(proc.url))
    after = complete(proc.url, "M" * 3000, max_tokens=4)
    assert after.status_code == 200, after.text
    assert all(d["outcome"] != "reject" for d in mem(proc.url)["decisions"])


def cache_limit(url: str) -> int:
    return int(mem(url)["allocator"]["cache_limit_bytes"])


def test_mlx_cache_limit_follows_the_ceiling(small_machine):
    proc = small_machine
    # MLX's CPU default, never raised: a balanced ceiling leaves far more room than that.
    assert cache_limit(proc.url) == MLX_CPU_DEFAULT_CACHE_LIMIT

    for room in (6 * MiB, 1 * MiB, 20 * MiB):
        live = live_bytes(proc.url)
        assert guard(proc.url, tier="custom", ceiling_bytes=live + room).status_code == 200
        # The ceiling less everything but the cache (the idle server's live bytes); live
        # bytes move by a few KiB between reads.
        assert abs(cache_limit(proc.url) - room) < 256 * 1024, (cache_limit(proc.url), room)

    # Under load, each decision sets it again, and MLX holds to it.
    live = live_bytes(proc.url)
    assert guard(proc.url, ceiling_bytes=live + 8 * MiB).status_code == 200
    r = complete(proc.url, "a short one", max_tokens=40)
    assert r.status_code == 200, r.text
    m = mem(proc.url)
    # the limit is the ceiling less the live bytes of the moment, which the request moved by
    # a few KiB (once 2 KiB down, the limit as many up): the same allowance as above
    assert 0 < m["allocator"]["cache_limit_bytes"] <= 8 * MiB + 256 * 1024
    assert m["allocator"]["cache_bytes"] <= m["allocator"]["cache_limit_bytes"]

    assert guard(proc.url, enabled=False).status_code == 200
    assert cache_limit(proc.url) == MLX_CPU_DEFAULT_CACHE_LIMIT
    assert guard(proc.url, enabled=True, tier="balanced").status_code == 200
    assert cache_limit(proc.url) == MLX_CPU_DEFAULT_CACHE_LIMIT


def test_memory_view_names_its_source_and_reports_the_peak(start_server):
    proc = start_server(args=ALLOCATOR)
    before = mem(proc.url)
    assert before["usage_source"] == "mlx_allocator"
    alloc = before["allocator"]
    # Usage is what the allocator probe counts: MLX's active bytes and its cache.
    assert before["usage_bytes"] == alloc["active_bytes"] + alloc["cache_bytes"]
    assert alloc["untracked_bytes"] == 0
    assert alloc["peak_bytes"] >= alloc["active_bytes"] > 0
    assert before["ceiling"]["fixed_binding"] == "static"

    r = complete(proc.url, "p" * 1500, max_tokens=20)
    assert r.status_code == 200, r.text
    after = mem(proc.url)
    # A 1,500-token prefill's KV and scores pass through: the peak saw them.
    assert after["allocator"]["peak_bytes"] >= before["allocator"]["peak_bytes"] + 3 * MiB
    assert after["engine"]["peak_bytes"] == after["allocator"]["peak_bytes"]


def test_a_guard_update_reaches_the_engine_even_when_idle(small_machine):
    proc = small_machine
    live = live_bytes(proc.url)
    r = httpx.put(f"{proc.url}/v1/memory-guard", json={"ceiling_bytes": live + 3 * MiB})
    assert r.status_code == 200, r.text
    assert abs(cache_limit(proc.url) - 3 * MiB) < 256 * 1024
