"""Prompts that share a chat template's first tokens, admitted while others decode.

    python -m bench.template_hits --segment-tokens 131072

32 prompts of a shared 9-token head and 200 distinct tokens arrive one per engine step
while earlier ones decode, in one large KV segment (as on CUDA). Prints the prefix-cache
hits, the wall time until all have joined the batch, and MLX's peak over the start. It
measures what a hit costs when it saves almost nothing: before a hit needed a whole block,
each copied its first block into a segment the queued decode step still read
(`docs/throughput.md`).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import mlx.core as mx

from engine import EngineRequest, SamplingParams, load_model
from engine.core import EngineConfig, EngineCore
from memory import MemoryGuard
from memory.probes.allocator import AllocatorProbe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--segment-tokens", type=int, default=131072)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--min-hit-tokens", type=int, help="override the engine's (a block)")
    a = p.parse_args()
    loaded = load_model(a.model, load_format="dummy", dtype=a.dtype)
    config = EngineConfig(prefill_step_size=512, max_concurrency=a.requests + 1,
                          kv_segment_tokens=a.segment_tokens)
    core = EngineCore(loaded, MemoryGuard(AllocatorProbe(), enabled=False), config, lambda outputs: None)
    if a.min_hit_tokens is not None:
        core.prefix_cache.min_hit_tokens = a.min_hit_tokens
    head = tuple(random.Random(0).randrange(0, 250) for _ in range(9))

    def request(i: int) -> EngineRequest:
        rng = random.Random(1000 + i)
        return EngineRequest(f"r{i}", head + tuple(rng.randrange(0, 250) for _ in range(200)), 64,
                             SamplingParams(temperature=0.0))

    core.submit_now(request(0))
    while len(core.batch) < 1:
        core.step()
    for _ in range(3):
        core.step()
    gc.collect()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    started = time.perf_counter()
    for i in range(1, a.requests + 1):
        core.submit_now(request(i))
        core.step()  # one arrives per step while the others decode
    while len(core.batch) < a.requests + 1:
        core.step()
    print(json.dumps({"hits": core.prefix_cache.hits, "wall_s": round(time.perf_counter() - started, 2),
                      "peak_over_start_mb": round((mx.get_peak_memory() - base) / 1e6, 1),
                      "segments": len(core.store.segments)}))


if __name__ == "__main__":
    main()
