"""Pay the backend's first-use kernel compilation before the first request, not inside it.

Measured on the H200 (docs/throughput.md):
in a fresh machine's first process the first prefill call took 19.2 s and a later one
2.7 s, while every request in flight waited (TTFT p95 23.6 s at C=32); a second process
on the same machine took 0.34 s for its first call, because the compiled kernels are
cached on disk by then, yet its first decode step still took 4.5 s, a per-process cost.
So where the backend compiles kernels on first use (CUDA), the engine runs three small
requests through its own path before the server reports ready:

- two prompts of one length (a batched, causal prefill call) and one shorter (a masked or
  a single call);
- decode at batch 3, then 2, then 1. Batch 3 and batch 1 each hold for twice
  `compile_after` + 2 steps, so that a compiled decode step (`engine.compiled_decode`) is
  traced and replayed at each, even where a row crosses a block boundary (which changes
  the traced graph's key) in the middle. On a fresh H200 the first trace in serving
  (batch 32) took 6.0 s, compiling its fused kernels. MLX names a fused kernel by its
  ops, dtypes and which inputs are 0-d (`Compiled`'s `kernel_lib_`), not by shapes, so
  batch 3's trace should build batch 32's kernels; batch 1 is traced too, since a size-1
  batch dimension may let MLX simplify broadcasts into another graph. Neither was
  measured on the H200;
- the lone row's blocks are consecutive, so it would be read as one slice of the pool,
  eagerly (`engine.kv.attention.run_decode`), and batch 1 never traced: the slice is held
  off until the row has had its paged steps, then it steps SLICE_STEPS more times on the
  slice, as a lone request on a run of blocks does in serving;
- the requests leave at different steps, so rows leave while the others' tokens are in
  flight, and the pending step is compacted with a gather. MLX compiled that gather
  (`gather_uint32_int32_1`) at the first real leave, 3.6 s inside a prefill call on a
  fresh H200: the one kernel the warm-up's other requests left for MLX to compile;
- one request asks for logprobs, so the sampler's logprob path and its compaction are
  warmed too.

They go through admission like any request, so a machine without room for them refuses
them rather than running out of memory; their outputs go nowhere, their prompts leave the
prefix cache afterwards, and what they freed is handed back to the device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv.plan_probe import measure_plan_ms
from engine.request import EngineRequest, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from engine.core import EngineCore

log = logging.getLogger("mlx_headroom.engine")

PROMPT_TOKENS = 64
STAGGER = 2  # steps at batch 2, between the first leave and the second
SLICE_STEPS = 3  # the lone row's last steps, read as one slice of the pool
MAX_STEPS = 1000  # a warm-up that has not finished by then gives up (nothing is lost)


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    requests: int
    finished: dict[str, str]  # request id -> finish reason ("length", or why it stopped)


def warm_up(core: EngineCore, *, prompt_tokens: int = PROMPT_TOKENS) -> WarmupReport:
    """Run the warm-up requests to completion on `core`, on the engine thread, before its loop."""
    started = time.perf_counter()
    shapes = (prompt_tokens, prompt_tokens, prompt_tokens // 2 + 5)
    # Steps at batch 3, and at 1: a streak of compile_after + 2 (traced, then replayed) even
    # if one block boundary, 16 tokens apart by default, falls inside.
    hold = 2 * (core.config.compile_after + 2)
    paged_tokens = hold + STAGGER + hold  # the lone row's tokens before the slice is let on
    new_tokens = (hold, hold + STAGGER, paged_tokens + SLICE_STEPS)
    requests = [
        EngineRequest(f"warmup-{i}", tuple((7 * i + j) % 256 for j in range(n)), new,
                      SamplingParams(temperature=0.0, logprobs=i == 1, top_logprobs=2 if i == 1 else 0))
        for i, (n, new) in enumerate(zip(shapes, new_tokens, strict=True))
    ]
    finished: dict[str, str] = {}
    generated = dict.fromkeys((r.request_id for r in requests), 0)
    runner = core.batch
    can_slice = runner.slice_decode is not False

    def sink(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            generated[out.request_id] += len(out.new_tokens)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
        if can_slice and runner.force_slice is False and generated[requests[-1].request_id] >= paged_tokens:
            runner.force_slice = True

    publish, core.publish = core.publish, sink
    runner.force_slice = False  # and untimed: first-use compilation would skew SliceChoice
    try:
        for r in requests:
            core.submit(r)
        for _ in range(MAX_STEPS):
            core._drain_inbox(timeout=0)
            if len(finished) == len(requests):
                break
            core.step()
        else:
            for r in requests:
                core.abort(r.request_id)
            core._drain_inbox(timeout=0)
            core.step()
        _measure_plans(core)  # before the hand-back, which returns its buffers too
    finally:
        core.publish = publish
        runner.force_slice = None
        core.prefix_cache.clear()
        core.step_budget.forget()  # first-use compilation is not what a prefill token costs
        # what it freed (its KV segment: 16 GiB on an H200 by default) would otherwise
        # stay in MLX's buffer cache, counted by the device, while the server sits idle
        core.admission.hand_back()
    report = WarmupReport(time.perf_counter() - started, len(requests), finished)
    core.warmup_s = report.seconds
    core._publish_stats()  # the idle engine's numbers, warm-up included, before any request
    outcomes = ", ".join(sorted(set(finished.values()))) or "none finished"
    if list(finished.values()) == ["length"] * len(requests):
        log.info("warmed up in %.2fs (%d requests)", report.seconds, report.requests)
    else:
        log.warning("warm-up did not complete (%s) in %.2fs: the first requests will pay for "
                    "first-use kernel compilation", outcomes, report.seconds)
    return report


def _measure_plans(core: EngineCore) -> None:
    """Where the store pads prefill keys and no plan cost was configured, time what a new
    attention shape costs to plan here (`engine.kv.plan_probe`) and price padding by it."""
    lengths = core.store.key_lengths
    if not core.store.key_bucket or core.config.prefill_plan_ms is not None or core.store.geometry is None:
        return
    g = core.store.geometry
    lengths.plan_ms = measure_plan_ms(core.loaded.geometry.num_heads, g.num_kv_heads, g.head_dim, g.dtype)
    lengths.plan_measured = True
    log.info("a new shape of prefill attention plans in %.1f ms here", lengths.plan_ms)
