"""The start-up warm-up (`engine.warmup`): it runs its requests through the engine's own
path, publishes nothing, leaves nothing behind, and is on where kernels compile on first
use. Real engines on the tiny float32 model; the server test starts a real server."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from engine import EngineRequest, SamplingParams
from engine.loader import on_cuda_by_default
from engine.warmup import warm_up
from tests.conftest import ServerProcess


@pytest.mark.parametrize("setting, backend, expected", [
    (None, "cuda", True),  # measured: a fresh machine's first prefill call took 19.2 s there
    (None, "cpu", False),
    (None, "metal", False),
    (True, "cpu", True),
    (False, "cuda", False),
])
def test_warm_up_is_on_where_kernels_compile_on_first_use(setting, backend, expected) -> None:
    """The switch the warm-up, compiled decode and decode overlap share."""
    assert on_cuda_by_default(setting, backend) is expected


def _request() -> EngineRequest:
    rng = random.Random(5)
    return EngineRequest("user-1", tuple(rng.randrange(0, 256) for _ in range(90)), 24,
                         SamplingParams(temperature=0.0, logprobs=True))


def test_a_warm_up_runs_prefill_and_decode_then_leaves_nothing_behind(make_engine) -> None:
    h = make_engine(prefill_step_size=64)
    report = warm_up(h.core)

    assert report.finished == {f"warmup-{i}": "length" for i in range(3)}
    assert h.core.stats.prefill_chunks >= 3 and h.core.stats.decode_steps >= 7
    assert h.core.stats.max_batch == 3  # the decode steps ran batched
    assert h.out.tokens == {} and h.out.finished == {}  # nothing reached the real publisher
    assert h.core.store.stats().request_bytes == 0  # every warm-up request's KV is released
    assert h.core.prefix_cache.stats().entries == 0
    assert mx.get_cache_memory() == 0  # its freed segment went back, not into MLX's cache
    assert not (h.core.waiting or h.core.prefilling or len(h.core.batch))
    assert h.core.stats.warmup_s == pytest.approx(report.seconds, abs=1e-3) and report.seconds > 0
    assert h.core.step_budget.cost.line is None and h.core.step_budget.decode_s is None

    # and a request afterwards is served exactly as by an engine that never warmed up
    cold = make_engine(prefill_step_size=64)
    for engine in (h, cold):
        engine.submit(_request())
        engine.run_until(lambda e=engine: "user-1" in e.out.finished)
    assert h.out.tokens["user-1"] == cold.out.tokens["user-1"]
    assert h.out.logprobs["user-1"] == pytest.approx(cold.out.logprobs["user-1"], abs=1e-5)


@pytest.mark.parametrize("chunk", [64, 2048])  # 2048: CUDA's default, all three prefill in one step
def test_a_warm_up_compacts_a_step_in_flight_as_rows_leave(make_engine, chunk: int) -> None:
    """A row leaving while the others' tokens are in flight gathers the pending step. MLX
    compiles that gather on first use: on a fresh H200 it was the one kernel the earlier
    warm-up missed, and it cost 3.6 s inside the first real leave. The logprob arrays are
    gathered too, when a row asks for them."""
    h = make_engine(prefill_step_size=chunk)
    runner = h.core.batch
    compacted: list[tuple[int, int, bool]] = []  # (rows kept in flight, rows in flight, logprobs)
    remove = runner.remove

    def spy(leaving):
        pending = runner.pending
        if pending is not None and leaving:
            gone = {id(s) for s in leaving}
            in_flight = pending.tokens.shape[0]
            kept = sum(id(s) not in gone for s in runner.seqs[:in_flight])
            compacted.append((kept, in_flight, pending.logprobs is not None))
        remove(leaving)

    runner.remove = spy
    warm_up(h.core)
    partial = [c for c in compacted if 0 < c[0] < c[1]]
    assert partial, compacted
    assert any(with_logprobs for *_, with_logprobs in partial)


def test_a_warm_up_traces_and_replays_a_compiled_decode_step(make_engine) -> None:
    """Where decode steps are compiled (CUDA's default), the first trace compiles its fused
    kernels: 6.0 s inside serving on a fresh H200. The warm-up holds batch 3 and batch 1
    long enough to be traced, and replayed, before the server is ready."""
    h = make_engine(prefill_step_size=2048, compile_decode=True)
    warm_up(h.core)
    compiled = h.core.batch.compiled
    assert compiled is not None
    assert {key[1] for key in compiled.graphs} >= {1, 3}  # traced at batch 3 and at batch 1
    assert compiled.replays > compiled.traces  # replayed after its traces, not only traced
    # the lone row's last steps were read as one slice of the pool, untimed: first-use
    # compilation must not decide the engine's choice between the two paths
    runner = h.core.batch
    assert runner.sliced_steps >= 2
    assert runner.force_slice is None
    assert runner.slice_choice is not None and runner.slice_choice.samples == {True: [], False: []}


def test_the_server_warms_up_before_it_reports_healthy(tiny_model_path: Path, tmp_path: Path) -> None:
    proc = ServerProcess(tiny_model_path, args=["--warm-up"])
    try:
        proc.start(tmp_path)  # returns once /health answers
        engine = httpx.get(proc.url + "/v1/memory").json()["engine"]
        assert engine["warmup_s"] > 0
        assert engine["running"] == engine["waiting"] == engine["kv_bytes"] == 0
        assert "warmed up in" in proc.log()
        # greedy: sampled, 1 request in 80 drew the end-of-text token by the fourth
        body = {"model": "mlx-headroom/tiny-chat", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.stop()


def test_a_warm_up_that_does_not_fit_is_refused_and_leaves_the_engine_serving(make_engine) -> None:
    """The warm-up asks admission like any request: under a ceiling with no room beyond
    what is in use, its requests are refused rather than run, and nothing is held."""
    from memory import MemoryGuard, Tier
    from memory.probes.allocator import AllocatorProbe

    tight = MemoryGuard(AllocatorProbe(), enabled=True, tier=Tier.CUSTOM,
                        custom_ceiling_bytes=mx.get_active_memory() + (64 << 10))
    h = make_engine(guard=tight, prefill_step_size=64)
    report = warm_up(h.core)
    assert set(report.finished) == {f"warmup-{i}" for i in range(3)}
    assert "length" not in report.finished.values()  # none ran to its end
    assert h.core.stats.generated_tokens == 0
    assert h.core.store.stats().request_bytes == 0
    assert not (h.core.waiting or h.core.prefilling or len(h.core.batch))


def test_a_warm_up_leaves_the_slice_off_where_it_is_set_off(make_engine) -> None:
    h = make_engine(prefill_step_size=2048, compile_decode=True, slice_decode=False)
    warm_up(h.core)
    assert h.core.batch.sliced_steps == 0
    assert h.core.batch.force_slice is None


def test_the_warm_up_times_a_new_attention_shapes_plan_where_keys_are_padded(make_engine) -> None:
    """Where the store pads prefill keys and no plan cost is configured, the warm-up prices
    padding by a plan timed here (the CPU plans nothing, but a first call still allocates),
    reported in the stats;
    a configured cost is kept, and a store that pads nothing times nothing."""
    padded = make_engine(prefill_step_size=64, prefill_key_bucket=64)
    warm_up(padded.core)
    keys = padded.core.stats.prefill_keys
    assert keys["plan_measured"] is True and keys["plan_ms"] >= 0  # what it is here is timing
    assert padded.core.store.key_lengths.plan_ms == pytest.approx(keys["plan_ms"], abs=1e-3)
    assert mx.get_cache_memory() == 0  # the probe's buffers went back with the rest
    configured = make_engine(prefill_step_size=64, prefill_key_bucket=64, prefill_plan_ms=20.0)
    warm_up(configured.core)
    assert configured.core.stats.prefill_keys["plan_ms"] == 20.0
    assert configured.core.stats.prefill_keys["plan_measured"] is False
    plain = make_engine(prefill_step_size=64)
    warm_up(plain.core)
    assert plain.core.stats.prefill_keys == {"bucket": 0, "plan_ms": 0.0, "plan_measured": False,
                                             "exact_calls": 0, "padded_calls": 0, "planned_ahead": 0,
                                             "planned_shapes": 0}


def test_calls_are_counted_exact_or_padded(make_engine) -> None:
    """The stats count prefill calls by the keys they attended: padded to the bucket, or
    exact where the bucket would have padded (the padding priced above a plan)."""
    counts = []
    for plan_ms in (1e9, 0.0):
        h = make_engine(prefill_step_size=160, prefill_key_bucket=64, prefill_plan_ms=plan_ms)
        h.submit(EngineRequest("r", tuple(random.Random(2).randrange(0, 256) for _ in range(300)), 2,
                               SamplingParams(temperature=0.0)))
        h.run_until(lambda h=h: "r" in h.out.finished)
        keys = h.core.stats.prefill_keys
        counts.append((keys["exact_calls"], keys["padded_calls"]))
    assert counts == [(0, 2), (2, 0)]  # 160 + 139 tokens: padded to 192 and 320, or exact
