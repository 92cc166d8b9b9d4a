"""What a batched prefill's attention mask costs in memory, by the mask's form.

    python -m bench.prefill_mask                       # llama3-8b's attention shape, bf16 (H200)
    python -m bench.prefill_mask --rows 2 --chunk 64 --context 512 --dtype float32   # a CPU

Why. On the H200, 40 concurrent 32k-token prompts (`bench.device_agreement --phases long`)
ran the device out of memory in batched prefill calls of three rows, past a ceiling the
admission had predicted them under (session 13, docs/throughput.md). A batch whose rows
differ in start or length carries an array mask `[B, 1, T, L]`. MLX's
`scaled_dot_product_attention` broadcasts it to every query head, `[B, Hq, T, L]`, and
where the backend takes no boolean mask (CUDA) it turns a boolean one into an additive one
with `where`, which materialises that broadcast shape: B × Hq × T × L elements per layer,
about 13.7 GB at three rows of 2,048 tokens over 34,816. An additive mask in the queries'
dtype is passed through as a broadcast view instead.

For each form (boolean, additive, SDPA's own "causal") this times one attention call of the
given shape and reports MLX's peak over the call's inputs, and the largest difference
between the boolean and the additive outputs. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv.masks import additive_mask


def masks(rows: int, chunk: int, context: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """A boolean mask and its additive twin (the engine's `additive_mask`, what batched
    prefill passes) for rows whose chunks end `chunk` tokens after starts a few tokens
    apart (so no row is the same shape as the first: an array mask)."""
    starts = np.asarray([context - chunk - 7 * i for i in range(rows)])
    ends = starts + chunk - np.arange(rows)  # lengths differ too: right padding
    q = np.arange(chunk)[None, :, None]
    k = np.arange(context)[None, None, :]
    allowed = ((k <= starts[:, None, None] + q) & (k < ends[:, None, None]))[:, None, :, :]
    boolean = mx.array(allowed)
    return boolean, additive_mask(boolean, dtype)


def measure(rows: int, chunk: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
            dtype: mx.Dtype) -> dict[str, Any]:
    q = mx.random.normal((rows, q_heads, chunk, head_dim)).astype(dtype)
    k = mx.random.normal((rows, kv_heads, context, head_dim)).astype(dtype)
    v = mx.random.normal((rows, kv_heads, context, head_dim)).astype(dtype)
    boolean, additive = masks(rows, chunk, context, dtype)
    mx.eval(q, k, v, boolean, additive)
    out: dict[str, Any] = {"rows": rows, "chunk": chunk, "context": context, "q_heads": q_heads,
                           "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype),
                           "broadcast_mask_bytes": rows * q_heads * chunk * context * dtype.size,
                           "mask_bytes": {"boolean": boolean.nbytes, "additive": additive.nbytes}}
    results = {}
    for name, mask in (("boolean", boolean), ("additive", additive), ("causal", "causal")):
        for _ in range(2):  # the first call compiles kernels (CUDA); the second is reported
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            start = time.perf_counter()
            y = mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim ** -0.5, mask=mask)
            mx.eval(y)
            ms = (time.perf_counter() - start) * 1e3
            peak = mx.get_peak_memory() - base
        results[name] = y
        out[name] = {"peak_over_inputs_bytes": int(peak), "ms": round(ms, 2)}
    diff = mx.abs(results["boolean"].astype(mx.float32) - results["additive"].astype(mx.float32))
    out["boolean_vs_additive_max_abs"] = float(mx.max(diff).item())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--context", type=int, default=34816)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    print(json.dumps(measure(a.rows, a.chunk, a.context, a.q_heads, a.kv_heads, a.head_dim,
                             getattr(mx, a.dtype))))


if __name__ == "__main__":
    main()
