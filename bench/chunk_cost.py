"""What a prefill chunk costs by its size and by the context it attends.

A long prompt prefilled beside decoding streams runs in chunks small enough to keep the
streams' gap between tokens under a target (`engine.step_budget`). Whether that costs the
long prompt little or much depends on how a chunk's time grows with its size deep in a
context: if a chunk of 128 tokens at 96k of context takes as long as one of 512, small
chunks waste most of the device. This script separates the parts, each timed on a shape
already seen (a backend that plans attention per shape has planned it):

- `attention`: `mx.fast.scaled_dot_product_attention` alone, `n` queries of the model's
  heads over `context + n` keys, causal, one layer, and the same with keys padded to the
  engine's buckets under an additive mask (`engine.kv.buckets`);
- `projections`: one layer's dense matmuls for `n` tokens (q, k, v, o, gate, up, down);
- `model`: the whole model through mlx-lm's own `KVCache`, a chunk of `n` tokens after
  `context` tokens were prefilled (the cache trimmed back after each timing);
- `store`: the whole model through the engine's paged KV store (`engine.kv`), the same
  chunks, three ways: keys always padded to the buckets and gathered (`padded_gather`:
  `--prefill-plan-ms` very large and no views), padded and read as a view of the pool
  (`padded_view`), and as the engine serves (`served`: padded or exact by `KeyLengths`,
  read as a view). Each is timed on its shape's first call (`first_ms`:
  plans and kernels built there) and warm (`ms`).

It prints one line per measurement and writes them as JSON (`--out`). Padding and mask are
the engine's own (`engine.kv.buckets`, `engine.kv.masks`), and nothing else of the project
runs: `python -m bench.chunk_cost --layers 32`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlx.core as mx

from bench.qmm_repro import timed_us
from engine.kv.buckets import CUDA_KEY_BUCKET, padded_keys
from engine.kv.masks import additive_mask

LLAMA_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}


def timed_ms(fn: Callable[[], object], iters: int) -> float:
    """Median of `iters` evaluated calls after two unmeasured ones (first use plans)."""
    return timed_us(fn, iters, warmup=2) / 1e3


def sdpa(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | str) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)


def attention_rows(
    cfg: dict, chunks: list[int], contexts: list[int], dtype: mx.Dtype, iters: int
) -> list[dict]:
    hq, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rows = []
    longest = max(contexts) + max(chunks)
    keys = mx.random.normal((1, hk, padded_keys(longest, CUDA_KEY_BUCKET), d)).astype(dtype)
    values = mx.random.normal((1, hk, padded_keys(longest, CUDA_KEY_BUCKET), d)).astype(dtype)
    mx.eval(keys, values)
    for c in contexts:
        for n in chunks:
            q = mx.random.normal((1, hq, n, d)).astype(dtype)
            total = c + n
            k, v = keys[:, :, :total], values[:, :, :total]
            exact = timed_ms(partial(sdpa, q, k, v, "causal"), iters)
            width = padded_keys(total, CUDA_KEY_BUCKET)
            mask = additive_mask(mx.arange(width)[None, :] <= (c + mx.arange(n))[:, None], dtype)[None, None]
            kp, vp = keys[:, :, :width], values[:, :, :width]
            pad = timed_ms(partial(sdpa, q, kp, vp, mask), iters)
            flops = 4 * hq * d * n * (c + n / 2)  # QK and PV over the keys each query sees
            row = {"part": "attention", "context": c, "tokens": n, "causal_ms": round(exact, 3),
                   "padded_ms": round(pad, 3), "padded_keys": width,
                   "causal_tflops": round(flops / exact / 1e9, 1),
                   "causal_us_per_token": round(exact * 1e3 / n, 2)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def layer_matmuls(xs: dict[int, mx.array], shapes: list[tuple[int, int]], weights: list[mx.array]) -> list:
    return [xs[i] @ w.T for (i, _), w in zip(shapes, weights, strict=True)]


def projection_rows(cfg: dict, chunks: list[int], dtype: mx.Dtype, iters: int) -> list[dict]:
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    hq, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = [(h, hq * d), (h, hk * d), (h, hk * d), (hq * d, h), (h, f), (h, f), (f, h)]
    weights = [mx.random.normal((o, i)).astype(dtype) * 0.02 for i, o in shapes]
    mx.eval(weights)
    rows = []
    for n in chunks:
        xs = {i: mx.random.normal((n, i)).astype(dtype) for i in {i for i, _ in shapes}}
        mx.eval(list(xs.values()))
        ms = timed_ms(partial(layer_matmuls, xs, shapes, weights), iters)
        flops = 2 * n * sum(i * o for i, o in shapes)
        row = {"part": "projections", "tokens": n, "layer_ms": round(ms, 3),
               "tflops": round(flops / ms / 1e9, 1), "us_per_token": round(ms * 1e3 / n, 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def trimmed_chunk(model: object, cache: list, tokens: mx.array) -> mx.array:
    """The chunk's last logits, its K/V then trimmed from the cache: the next call sees
    the same context and the same shapes."""
    out = model(tokens, cache=cache)[:, -1]
    mx.eval(out)
    for layer in cache:
        layer.trim(tokens.shape[1])
    return out


def model_rows(cfg: dict, chunks: list[int], contexts: list[int], dtype: mx.Dtype, iters: int) -> list[dict]:
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    cache = make_prompt_cache(model)
    vocab = cfg["vocab_size"]
    filled = 0
    rows = []
    for c in sorted(contexts):
        while filled < c:
            step = min(4096, c - filled)
            mx.eval(model(mx.random.randint(0, vocab, (1, step)), cache=cache))
            filled += step
        for n in chunks:
            tokens = mx.random.randint(0, vocab, (1, n))
            ms = timed_ms(partial(trimmed_chunk, model, cache, tokens), iters)
            row = {"part": "model", "context": c, "tokens": n, "chunk_ms": round(ms, 2),
                   "us_per_token": round(ms * 1e3 / n, 1), "tok_s": round(n / ms * 1e3)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


STORE_VARIANTS = ("padded_gather", "padded_view", "served")


def store_chunk(model: object, store: object, alloc: object, tokens: mx.array) -> mx.array:
    """The chunk's last logits through the store, written where the last call wrote it:
    each call sees the same context."""
    from engine.kv import prefill_caches

    out = model(tokens, cache=prefill_caches(store, alloc, tokens.shape[1]))[:, -1]
    mx.eval(out, alloc.segment.arrays())
    return out


def store_rows(cfg: dict, chunks: list[int], contexts: list[int], dtype: mx.Dtype, iters: int) -> list[dict]:
    from mlx_lm.models import llama

    from engine.kv import KVGeometry, KVStore, install_attention_hook, prefill_caches
    from engine.kv.buckets import CUDA_PLAN_MS

    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    install_attention_hook(model)
    layers, hq, hk, d = (cfg["num_hidden_layers"], cfg["num_attention_heads"],
                         cfg["num_key_value_heads"], cfg["head_dim"])
    longest = max(contexts) + max(chunks)
    store = KVStore(KVGeometry(layers, hk, d, dtype), segment_tokens=padded_keys(longest, CUDA_KEY_BUCKET),
                    key_bucket=CUDA_KEY_BUCKET, pair_flops=4 * hq * d * layers, plan_ms=CUDA_PLAN_MS)
    alloc = store.reserve("chunk-cost", longest)
    vocab = cfg["vocab_size"]
    rows = []
    for c in sorted(contexts):
        while alloc.length < c:
            step = min(4096, c - alloc.length)
            model(mx.random.randint(0, vocab, (1, step)), cache=prefill_caches(store, alloc, step))
            mx.eval(alloc.segment.arrays())
            store.advance("chunk-cost", step)
        for n in chunks:
            tokens = mx.random.randint(0, vocab, (1, n))
            row: dict = {"part": "store", "context": c, "tokens": n}
            for variant in STORE_VARIANTS:
                store.prefill_views = variant != "padded_gather"
                store.key_lengths.pair_flops = 4 * hq * d * layers if variant == "served" else 0
                keys = store.key_lengths.keys(n, c + n)
                chunk = partial(store_chunk, model, store, alloc, tokens)
                first = timed_us(chunk, 1, warmup=0) / 1e3
                row[variant] = {"keys": keys, "first_ms": round(first, 2),
                                "ms": round(timed_ms(chunk, iters), 2)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--contexts", type=int, nargs="+", default=[0, 8192, 32768, 65536, 98304])
    p.add_argument("--layers", type=int, default=LLAMA_8B["num_hidden_layers"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--parts", nargs="+", default=["attention", "projections", "model", "store"])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    cfg = {**LLAMA_8B, "num_hidden_layers": args.layers}
    rows: list[dict] = []
    if "attention" in args.parts:
        rows += attention_rows(cfg, args.chunks, args.contexts, dtype, args.iters)
    if "projections" in args.parts:
        rows += projection_rows(cfg, args.chunks, dtype, args.iters)
    if "model" in args.parts:
        rows += model_rows(cfg, args.chunks, args.contexts, dtype, args.iters)
    if "store" in args.parts:
        rows += store_rows(cfg, args.chunks, args.contexts, dtype, args.iters)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": str(mx.default_device()), "config": cfg,
                                        "dtype": args.dtype, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
