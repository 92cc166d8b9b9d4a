"""Decode-step cost without HTTP: a bare batched model step against the engine's step.

    python -m bench.engine_step --model llama3-8b --dtype bfloat16 --batch 32 --context 1024

The difference between the two is the engine's per-step bookkeeping (sampling, stop
checks, reading tokens back) and its KV store's paged attention; on a GPU it is what the
decode loop adds to the model. `bench/kv_store.py` compares the store with the left-padded
`BatchKVCache` directly.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from engine.dummy_model import build_dummy_model, dummy_config
from engine.kv import KVGeometry, KVStore, install_attention_hook
from engine.request import EngineRequest, SamplingParams
from engine.runner import Runner
from engine.sequence import Sequence
from memory import geometry_from_model


def prefilled_caches(model, context: int) -> list:
    caches = make_prompt_cache(model)
    tokens = mx.random.randint(0, 256, (1, context))
    for start in range(0, context, 2048):
        model(tokens[:, start:start + 2048], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def bare_steps(model, batch: int, context: int, steps: int) -> float:
    one = prefilled_caches(model, context)
    cache = [BatchKVCache.merge([c] * batch) for c in one]
    y = mx.zeros((batch,), mx.uint32)
    for _ in range(3):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
    start = time.perf_counter()
    for _ in range(steps):
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
    mx.eval(y)
    return (time.perf_counter() - start) / steps


def engine_steps(model, batch: int, context: int, steps: int, temperature: float) -> float:
    one = prefilled_caches(model, context - 1)
    g = geometry_from_model(model)
    store = KVStore(KVGeometry(g.num_layers, g.num_kv_heads, g.head_dim, one[0].keys.dtype),
                    segment_tokens=batch * (context + steps + 32))
    install_attention_hook(model)
    decode = Runner(model, store, overlap=mx.cuda.is_available())
    params = SamplingParams(temperature=temperature)
    for i in range(batch):
        seq = Sequence(EngineRequest(f"r{i}", (1,) * context, steps + 8, params))
        alloc = store.reserve(seq.request_id, context + steps + 8)
        n = context - 1
        slots = mx.array([alloc.table[j // store.block_size] * store.block_size + j % store.block_size
                          for j in range(n)], dtype=mx.int32)
        for layer, c in enumerate(one):
            alloc.segment.keys[layer][slots] = c.keys[0, :, :n, :].transpose(1, 0, 2)
            alloc.segment.values[layer][slots] = c.values[0, :, :n, :].transpose(1, 0, 2)
        mx.eval(alloc.segment.arrays())
        store.advance(seq.request_id, n)
        decode.join(seq)
    for _ in range(3):
        decode.step()
    start = time.perf_counter()
    for _ in range(steps):
        for item in decode.step():
            item.seq.generated += 1
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype")
    p.add_argument("--batch", default="1,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    model = build_dummy_model(dummy_config(args.model, args.dtype))
    mx.eval(model.parameters())
    out = []
    for b in (int(x) for x in args.batch.split(",")):
        bare = bare_steps(model, b, args.context, args.steps)
        greedy = engine_steps(model, b, args.context, args.steps, 0.0)
        sampled = engine_steps(model, b, args.context, args.steps, 0.8)
        out.append({"batch": b, "context": args.context, "bare_ms": round(bare * 1e3, 2),
                    "engine_greedy_ms": round(greedy * 1e3, 2),
                    "engine_sampled_ms": round(sampled * 1e3, 2),
                    "engine_tok_s": round(b / greedy, 1)})
        print(json.dumps(out[-1]), flush=True)


if __name__ == "__main__":
    main()
