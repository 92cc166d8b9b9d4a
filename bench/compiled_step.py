"""Would `mx.compile` cut the decode step? The runner's step, eager against compiled.

    python -m bench.compiled_step --model llama3-8b --dtype bfloat16 --batch 32 --context 1024

On the H200 the decode step is host-bound (`docs/throughput.md`): the model's Python builds
~1,650 ops per step and MLX encodes each. A compiled step replays its traced graph without
Python and fuses elementwise ops. This measures both paths on one filled KV store, greedy,
and checks that they pick the same tokens. The compiled path is the engine's own
(`engine.compiled_decode`, off by default in the server), here tracing each graph key at
its first step; the bench reports how long a trace takes.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from bench.engine_step import fill_row, prefilled_caches
from engine.compiled_decode import CompiledDecode
from engine.dummy_model import build_dummy_model, dummy_config
from engine.kv import KVGeometry, KVStore, decode_caches, install_attention_hook, plan_decode
from memory import geometry_from_model


def fill(model: Any, batch: int, context: int, extra: int) -> tuple[KVStore, list[Any]]:
    mx.random.seed(0)  # the same context for both paths
    one = prefilled_caches(model, context - 1)
    g = geometry_from_model(model)
    store = KVStore(KVGeometry(g.num_layers, g.num_kv_heads, g.head_dim, one[0].keys.dtype),
                    segment_tokens=batch * (context + extra + 32))
    return store, [fill_row(store, one, f"r{i}", context, context + extra) for i in range(batch)]


def eager_step(model: Any, store: KVStore, allocs: list[Any], tokens: mx.array) -> mx.array:
    plan = plan_decode(store, allocs)
    logits = model(tokens[:, None], cache=decode_caches(plan, store.geometry.num_layers))[:, -1, :]
    return mx.argmax(logits, axis=-1).astype(mx.uint32)


class CompiledStep:
    """The engine's compiled decode step (`engine.compiled_decode`), tracing a shape at its
    first step; `trace_s` holds how long each step that traced took."""

    def __init__(self, model: Any, store: KVStore) -> None:
        self.store = store
        self.compiled = CompiledDecode(model, store, model.args.num_attention_heads, after=1, keep=64)
        self.trace_s: list[float] = []

    def __call__(self, allocs: list[Any], tokens: mx.array) -> mx.array:
        traces = self.compiled.traces
        started = time.perf_counter()
        logits = self.compiled.logits(plan_decode(self.store, allocs), tokens)
        assert logits is not None, "the bench's rows live in one segment, so every step replays"
        if self.compiled.traces > traces:
            self.trace_s.append(time.perf_counter() - started)
        return mx.argmax(logits, axis=-1).astype(mx.uint32)


def run(step: Callable[..., mx.array], store: KVStore, allocs: list[Any],
        steps: int) -> tuple[float, list[list[int]], int]:
    """Seconds per step, the tokens of every step, and MLX's peak over the start."""
    tokens = mx.zeros((len(allocs),), mx.uint32)
    seen = []
    times = []
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for i in range(steps + 2):
        started = time.perf_counter()
        nxt = step(allocs, tokens)
        mx.async_eval(nxt)
        seen.append(tokens.tolist())
        if i >= 2:
            times.append(time.perf_counter() - started)
        for a in allocs:
            store.advance(a.request_id, 1)
        tokens = nxt
    seen.append(tokens.tolist())
    return sum(times) / len(times), seen, mx.get_peak_memory() - base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    model = build_dummy_model(dummy_config(a.model, a.dtype))
    mx.eval(model.parameters())
    install_attention_hook(model)
    out: dict[str, Any] = {"batch": a.batch, "context": a.context, "device": str(mx.default_device())}
    store, allocs = fill(model, a.batch, a.context, a.steps + 8)
    eager_s, eager_tokens, eager_peak = run(lambda al, t: eager_step(model, store, al, t), store, allocs,
                                            a.steps)
    layer_mb = store.segments[0].keys[0].nbytes / 1e6
    del store, allocs
    store, allocs = fill(model, a.batch, a.context, a.steps + 8)
    step = CompiledStep(model, store)
    compiled_s, compiled_tokens, compiled_peak = run(step, store, allocs, a.steps)
    same = [x == y for x, y in zip(eager_tokens, compiled_tokens, strict=True)]
    out.update(eager_ms=round(eager_s * 1e3, 2), compiled_ms=round(compiled_s * 1e3, 2),
               traces=step.compiled.traces, trace_s=[round(t, 3) for t in step.trace_s],
               same_tokens=all(same), first_difference=None if all(same) else same.index(False),
               # a step's peak over its start, against one layer array of the pool: a step
               # that copied the pool instead of writing in place would exceed it
               peak_mb={"eager": round(eager_peak / 1e6, 1),
                        "compiled": round(compiled_peak / 1e6, 1)},
               pool_layer_array_mb=round(layer_mb, 1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
