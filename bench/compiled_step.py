"""Would `mx.compile` cut the decode step? The runner's step, eager against compiled.

    python -m bench.compiled_step --model llama3-8b --dtype bfloat16 --batch 32 --context 1024

On the H200 the decode step is host-bound (`docs/throughput.md`): the model's Python builds
~1,650 ops per step and MLX encodes each. A compiled step replays its traced graph without
Python and fuses elementwise ops. This measures both paths on one filled KV store, greedy,
and checks that they pick the same tokens. It is an experiment, not the engine's path:

- the step is a pure function of the tokens, the plan's arrays and the segment's layer
  arrays, which it returns updated (the KV writes);
- it is traced once per (batch, table width, kernel partitions): the partition count is
  baked into the kernel's launch, so a new count needs a new trace, as would a join or a
  leave (a new batch size). The bench reports how long a trace takes.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from bench.engine_step import fill_row, prefilled_caches
from engine.dummy_model import build_dummy_model, dummy_config
from engine.kv import KVGeometry, KVStore, decode_caches, install_attention_hook, plan_decode
from engine.kv.cache import DecodeGroup, DecodePlan
from engine.kv.cuda_decode import partition_tokens
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
    """A step that traces once per (batch, table width, partitions) and replays after;
    `trace_s` holds how long each first call (trace) took."""

    def __init__(self, model: Any, store: KVStore) -> None:
        (self.segment,) = store.segments.values()
        self.model, self.store = model, store
        self.traced: dict[tuple[int, int, int], Any] = {}
        self.trace_s: list[float] = []

    def __call__(self, allocs: list[Any], tokens: mx.array) -> mx.array:
        store, segment = self.store, self.segment
        layers = store.geometry.num_layers
        plan = plan_decode(store, allocs)
        (g,) = plan.groups
        part = partition_tokens(len(allocs), store.geometry.num_kv_heads, g.max_length)
        key = (len(allocs), g.table.shape[1], -(-g.max_length // part))
        fn = self.traced.get(key)
        started = time.perf_counter()
        if fn is None:
            fn = self.traced[key] = mx.compile(self._forward(g.max_length))
        out = fn(tokens, g.write, g.table, g.lengths, plan.offsets, *segment.keys, *segment.values)
        if len(self.trace_s) < len(self.traced):
            self.trace_s.append(time.perf_counter() - started)
        segment.keys[:], segment.values[:] = list(out[1:1 + layers]), list(out[1 + layers:])
        return out[0]

    def _forward(self, max_length: int) -> Callable[..., tuple[mx.array, ...]]:
        """The step as a function of arrays only; `max_length` matters to the trace only
        through its partition count (the key above)."""
        store, segment, model = self.store, self.segment, self.model
        layers = store.geometry.num_layers

        def forward(tok, write, table, lengths, offsets, *pool):
            keys, values = segment.keys, segment.values
            segment.keys, segment.values = list(pool[:layers]), list(pool[layers:])
            try:
                group = DecodeGroup(segment, None, write, table, lengths, max_length)
                caches = decode_caches(DecodePlan([group], offsets, None, store.block_size), layers)
                logits = model(tok[:, None], cache=caches)[:, -1, :]
                return (mx.argmax(logits, axis=-1).astype(mx.uint32), *segment.keys, *segment.values)
            finally:
                segment.keys, segment.values = keys, values

        return forward


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
               traces=len(step.traced), trace_s=[round(t, 3) for t in step.trace_s],
               same_tokens=all(same), first_difference=None if all(same) else same.index(False),
               # a step's peak over its start, against one layer array of the pool: a step
               # that copied the pool instead of writing in place would exceed it
               peak_mb={"eager": round(eager_peak / 1e6, 1),
                        "compiled": round(compiled_peak / 1e6, 1)},
               pool_layer_array_mb=round(layer_mb, 1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
