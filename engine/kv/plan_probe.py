"""What planning a new shape of prefill attention costs on this machine.

`KeyLengths` (`engine.kv.buckets`) pads a prefill call's keys only where the padding costs
more than a new shape's plan would. That plan's cost is the card's and the library's: 35 ms
was measured on an H200 with MLX 0.32.4, and another card or another cuDNN may differ. So
the start-up warm-up (`engine.warmup`) times it where attention is planned per shape: a
causal call at a key length the engine has not used, against the same call again, after a
first length has compiled the kernels. The difference is the plan.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

QUERIES = 512
# Key lengths no padded call attends (not a power of two nor a multiple of the bucket): the
# first compiles the kernels, the others are timed new and again.
KEYS = (4096 + 272, 4096 + 528, 4096 + 784)
REPEATS = 3


def _call(q: mx.array, k: mx.array, v: mx.array, keys: int) -> float:
    started = time.perf_counter()
    out = mx.fast.scaled_dot_product_attention(q, k[:, :, :keys], v[:, :, :keys],
                                               scale=q.shape[-1] ** -0.5, mask="causal")
    mx.eval(out)
    return time.perf_counter() - started


def measure_plan_ms(num_heads: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype) -> float:
    """Milliseconds a new key length's first causal call takes over its later ones (the mean
    over two new lengths; never below 0)."""
    q = mx.random.normal((1, num_heads, QUERIES, head_dim)).astype(dtype)
    k = mx.random.normal((1, num_kv_heads, max(KEYS), head_dim)).astype(dtype)
    v = mx.random.normal((1, num_kv_heads, max(KEYS), head_dim)).astype(dtype)
    mx.eval(q, k, v)
    _call(q, k, v, KEYS[0])
    _call(q, k, v, KEYS[0])
    plans = []
    for keys in KEYS[1:]:
        first = _call(q, k, v, keys)
        again = statistics.median(_call(q, k, v, keys) for _ in range(REPEATS))
        plans.append(max(first - again, 0.0) * 1e3)
    return statistics.mean(plans)
