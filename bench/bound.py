"""The bare model's bound for a throughput point, measured on this machine in this run.

    python -m bench.bound --model tiny --dtype float32 --prompt-tokens 1000 --max-tokens 256 \\
        --concurrency 1,8,32,64

No server, no engine, no KV store: mlx-lm's model with its own contiguous `KVCache`.

- **Prefill rate**: B prompts of P tokens in one call, for B in 1, 2, 4, 8 (and each
  concurrency up to 8), timed on the second run of each shape (the first compiles kernels
  on CUDA), evaluating the caches only (as serving does: no logits for the prompt).
  The best tokens/s over B is "the bare model's best batched prefill rate".
- **Decode step**: one token per row at batch C, the context at P + T/2 (the middle of
  the decode), unmasked (equal lengths, a batched `KVCache`), argmax sampling, pipelined
  with `mx.async_eval` as mlx-lm does. Median of the timed steps.
- **Bound** for C concurrent requests: C·P tokens at the best prefill rate, plus
  T decode steps at batch C; a point of R requests runs ceil(R / C) such waves. Output
  tokens over that time is the bound in tokens/s.
- **Physical bound** (`physical`, on the cards in `PEAKS`): the same waves at the card's
  datasheet peaks, a decode step reading the weights and the batch's KV at its HBM
  bandwidth and a prompt token costing 2 × parameters FLOPs at its dense bf16 rate;
  `python -m bench table` prints each figure's fraction of it.

Prints one JSON object (bench/run.py stores it beside the throughput points; the summary's
`bare` rows are these bounds).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache

from engine.dummy_model import build_dummy_model, dummy_config


def _prefill_s(model: Any, batch: int, tokens: int, chunk: int) -> float:
    x = mx.random.randint(0, 200, (batch, tokens)).astype(mx.uint32)
    mx.eval(x)
    runs = []
    for _ in range(3):  # the first compiles (CUDA); the best of the others is timed
        cache = make_prompt_cache(model)
        mx.synchronize()
        start = time.perf_counter()
        for s in range(0, tokens, chunk):
            model(x[:, s:s + chunk], cache=cache)
            mx.eval([c.state for c in cache])
        runs.append(time.perf_counter() - start)
        del cache
        mx.clear_cache()
    return min(runs[1:])


def _repeat_rows(cache: Any, batch: int) -> None:
    """One row's cache as `batch` equal rows: keys and values (full or window layers), or
    a recurrent layer's conv window and state (`ArraysCache`), or each child of a `CacheList`."""
    if isinstance(cache, CacheList):
        for child in cache.caches:
            _repeat_rows(child, batch)
    elif isinstance(cache, ArraysCache):
        cache.cache = [None if a is None else mx.repeat(a, batch, axis=0) for a in cache.cache]
    else:
        n = cache.offset
        cache.keys = mx.repeat(cache.keys[..., :n, :], batch, axis=0)
        cache.values = mx.repeat(cache.values[..., :n, :], batch, axis=0)


def _decode_step_s(model: Any, batch: int, context: int, steps: int) -> float:
    cache = make_prompt_cache(model)
    one = mx.random.randint(0, 200, (1, context)).astype(mx.uint32)
    for s in range(0, context, 2048):
        model(one[:, s:s + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    for c in cache:  # the same context for every row: no padding, no mask
        _repeat_rows(c, batch)
    mx.eval([c.state for c in cache])
    y = mx.zeros((batch,), mx.uint32)
    for _ in range(3):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1).astype(mx.uint32)
        mx.eval(y)
    times = []
    last = time.perf_counter()
    for _ in range(steps):
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1).astype(mx.uint32)
        mx.async_eval(nxt)
        y.tolist()
        now = time.perf_counter()
        times.append(now - last)
        last = now
        y = nxt
    mx.eval(y)
    del cache
    mx.clear_cache()
    return statistics.median(times[1:])


def measure(model: Any, *, prompt_tokens: int, max_tokens: int, concurrency: list[int],
            prefill_chunk: int, decode_steps: int) -> dict[str, Any]:
    started = time.monotonic()
    prefill = []
    for b in sorted({1, 2, 4, 8} | {c for c in concurrency if c <= 8}):
        s = _prefill_s(model, b, prompt_tokens, prefill_chunk)
        prefill.append({"batch": b, "s": round(s, 4), "tok_s": round(b * prompt_tokens / s, 1)})
    best = max(prefill, key=lambda p: p["tok_s"])
    context = prompt_tokens + max_tokens // 2
    decode = {}
    for c in concurrency:
        decode[c] = _decode_step_s(model, c, context, decode_steps)
    return {
        "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "prefill_chunk": prefill_chunk,
        "prefill": prefill, "best_prefill_tok_s": best["tok_s"], "best_prefill_batch": best["batch"],
        "decode_context": context,
        "decode_step_ms": {str(c): round(s * 1e3, 3) for c, s in decode.items()},
        "measured_s": round(time.monotonic() - started, 1),
    }


def bound(b: dict[str, Any], concurrency: int, requests: int) -> dict[str, float]:
    """The bare model's time and tokens/s for `requests` requests at `concurrency`."""
    step = b["decode_step_ms"][str(concurrency)] / 1e3
    waves = math.ceil(requests / concurrency)
    prefill_s = concurrency * b["prompt_tokens"] / b["best_prefill_tok_s"]
    wave_s = prefill_s + b["max_tokens"] * step
    total = waves * wave_s
    return {"bound_s": round(total, 3), "bound_tok_s": round(requests * b["max_tokens"] / total, 2),
            "bound_prefill_s": round(prefill_s, 3), "bound_decode_step_ms": round(step * 1e3, 3),
            "bound_ttft_p50_s": round(prefill_s / 2, 3)}


# The card's datasheet peaks, by a part of its name: HBM bytes/s, dense bf16 tensor FLOP/s.
PEAKS = (("H200", 4.8e12, 989e12), ("H100", 3.35e12, 989e12))


def _peaks(data: dict[str, Any]) -> tuple[float, float] | None:
    name = ((data.get("machine") or {}).get("device_info") or {}).get("device_name") or ""
    return next(((bw, flops) for part, bw, flops in PEAKS if part in name), None)


def peak_bandwidth(data: dict[str, Any]) -> float | None:
    """The run's card's HBM bytes/s by its datasheet, or None off the cards in PEAKS."""
    peak = _peaks(data)
    return peak[0] if peak else None


def physical(data: dict[str, Any]) -> dict[str, float] | None:
    """A run's physical bound inputs (the card's peaks, the weights' bytes and parameters, KV
    bytes per token), or None off the cards in PEAKS or on quantized weights."""
    from memory.estimate import geometry_from_config

    peak = _peaks(data)
    model, config = data.get("model") or {}, data.get("model_config") or {}
    width = {"bfloat16": 2, "float16": 2, "float32": 4}.get(str(model.get("dtype")))
    if peak is None or width is None or not model.get("weight_bytes") or not config:
        return None
    kv = geometry_from_config(config, dtype_bytes=width).kv_bytes_per_token
    return {"bytes_per_s": peak[0], "flops": peak[1], "weight_bytes": model["weight_bytes"],
            "params": model["weight_bytes"] / width, "kv_bytes_per_token": kv}


def physical_tok_s(phys: dict[str, float], *, prompt_tokens: int, max_tokens: int, concurrency: int,
                   requests: int) -> float:
    """Output tok/s at the card's peaks: ceil(R / C) waves of C·P prompt tokens at 2 ×
    parameters FLOPs each, then T decode steps that each read the weights and the batch's KV
    at the decode's middle (P + T/2 tokens a row)."""
    prefill_s = concurrency * prompt_tokens * prefill_flops_per_token(phys) / phys["flops"]
    kv_bytes = concurrency * (prompt_tokens + max_tokens / 2) * phys["kv_bytes_per_token"]
    step_bytes = phys["weight_bytes"] + kv_bytes
    wave_s = prefill_s + max_tokens * step_bytes / phys["bytes_per_s"]
    return requests * max_tokens / (math.ceil(requests / concurrency) * wave_s)


def prefill_flops_per_token(phys: dict[str, float]) -> float:
    return 2 * phys["params"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=40)
    p.add_argument("--model-dir", help="load this mlx-lm model directory (e.g. a quantized one) instead")
    args = p.parse_args()
    if args.model_dir:
        from mlx_lm.utils import load_model

        model, _ = load_model(Path(args.model_dir))
    else:
        model = build_dummy_model(dummy_config(args.model, args.dtype))
    mx.eval(model.parameters())
    out = measure(model, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                  concurrency=[int(c) for c in args.concurrency.split(",")],
                  prefill_chunk=args.prefill_chunk, decode_steps=args.decode_steps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
