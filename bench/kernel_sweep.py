"""The paged decode kernel alone, across its launch settings (CUDA only).

    python -m bench.kernel_sweep --context 1100 --batch 1,32,64

For each variant (partition sizes, target grid size, tokens per warp step) it checks the
kernel against the plain-MLX path and times 32 layers' attention (kernel + merge) at each
batch, printing ms, the KV bandwidth it reached and the (tokens per partition, partitions)
chosen. Session 8 found the paged kernel at 41 % of a batch-32 step's device time, at about
1 TB/s under ncu (`bench.ncu_summary`); this asks whether its knobs alone fix that.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from bench.kv_store import kernel_vs_plain, ragged
from engine.kv import cuda_decode

BASE = cuda_decode.PARTITIONS
FINE = (16, 32, *BASE)
# name, partition sizes, target blocks, tokens per warp step
VARIANTS = [("current", BASE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL),
            ("target4k", BASE, 4224, 4), ("unroll8", BASE, 1056, 8), ("target4k_unroll8", BASE, 4224, 8),
            ("fine_target4k_unroll8", FINE, 4224, 8), ("fine_target16k_unroll8", FINE, 16896, 8),
            ("fine_target4k_unroll16", FINE, 4224, 16), ("fine_target4k_unroll4", FINE, 4224, 4)]


def time_attention(batch: int, length: int, layers: int = 32, iters: int = 20) -> dict[str, object]:
    bs, kv_heads, dim = 16, 8, 128
    nb = -(-length // bs)
    total = batch * nb
    table = mx.array(np.random.default_rng(1).permutation(total).astype(np.int32).reshape(batch, nb))
    k = mx.random.normal((total * bs, kv_heads, dim)).astype(mx.bfloat16)
    v = mx.random.normal((total * bs, kv_heads, dim)).astype(mx.bfloat16)
    q = mx.random.normal((batch, 32, 1, dim)).astype(mx.bfloat16)
    lens = mx.full((batch,), length, mx.int32)

    def run() -> mx.array:
        return mx.stack([cuda_decode.paged_decode(q, k, v, table, lens, length, 0.088, bs)
                         for _ in range(layers)])

    for _ in range(3):
        mx.eval(run())
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(run())
    mx.synchronize()
    s = (time.perf_counter() - start) / iters
    kv_bytes = batch * length * kv_heads * dim * 2 * 2 * layers
    return {"ms": round(s * 1e3, 3), "gb_s": round(kv_bytes / s / 1e9), "split": cuda_decode.partition_split(
        batch, kv_heads, length)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=1100)
    p.add_argument("--batch", default="1,32,64")
    args = p.parse_args()
    for name, parts, target, unroll in VARIANTS:
        cuda_decode.PARTITIONS, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL = parts, target, unroll
        cuda_decode._launch.cache_clear()
        err = max(kernel_vs_plain(mx.bfloat16, 5, 32, 8, 128, [1, 17, 300, 1024, 4099])["max_abs_err"],
                  kernel_vs_plain(mx.float32, 64, 32, 8, 128, ragged(64, 1000))["max_abs_err"])
        row: dict[str, object] = {"variant": name, "max_abs_err": err}
        for b in (int(x) for x in args.batch.split(",")):
            row[f"b{b}"] = time_attention(b, args.context)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
