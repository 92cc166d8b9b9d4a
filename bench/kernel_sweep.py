"""The paged decode kernel alone, across its launch settings (CUDA only).

    python -m bench.kernel_sweep --context 1100 --batch 1,32,64

For each variant (partition sizes, target grid size, tokens per warp step) it checks the
kernel against the plain-MLX path and times 32 layers' attention (kernel + merge) at each
batch, printing ms, the KV bandwidth it reached and the (tokens per partition, partitions)
chosen. Session 8 found the paged kernel at 41 % of a batch-32 step's device time, at about
1 TB/s under ncu (`bench.ncu_summary`); this asks whether its knobs alone fix that. They did
not (bench/results/h200-20261202-s8/kernel-sweep.jsonl): the current settings were the best.

The `vector_*` variants are the next hypothesis, not yet run on a GPU. Each lane reads its
E = D/32 elements of a K or V row as E separate 2-byte loads; these read them as one
E-element load (8 bytes for bf16 at D=128) and keep them packed in the model's dtype until
used, so a warp has fewer load instructions and half the registers per token in flight.
They need E * sizeof(T) to be a power of two (so not D=96), which is why they live here
until measured: the sweep checks each against the plain path before it times it.
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
_SCALAR_LOADS = """\
        float kv[U][E];
        float vv[U][E];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const bool live = j0 + u < end;
            const size_t base = base0 + (size_t)u * H * D;
            #pragma unroll
            for (int e = 0; e < E; ++e) {
                kv[u][e] = live ? static_cast<float>(k_pool[base + e]) : 0.f;
                vv[u][e] = live ? static_cast<float>(v_pool[base + e]) : 0.f;
            }
        }"""
_VECTOR_LOADS = """\
        struct alignas(sizeof(T) * E) Pack { T x[E]; };
        Pack kp[U];
        Pack vp[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const size_t base = base0 + (size_t)u * H * D;
            if (j0 + u < end) {
                kp[u] = *reinterpret_cast<const Pack*>(k_pool + base);
                vp[u] = *reinterpret_cast<const Pack*>(v_pool + base);
            } else {
                #pragma unroll
                for (int e = 0; e < E; ++e) {
                    kp[u].x[e] = static_cast<T>(0.f);
                    vp[u].x[e] = static_cast<T>(0.f);
                }
            }
        }"""


def vector_source() -> str:
    """The paged kernel with packed loads (see the module's docstring)."""
    src = cuda_decode._SOURCE
    for old, new in ((_SCALAR_LOADS, _VECTOR_LOADS),
                     ("qv[r][e] * kv[u][e]", "qv[r][e] * static_cast<float>(kp[u].x[e])"),
                     ("pr * vv[u][e]", "pr * static_cast<float>(vp[u].x[e])")):
        if old not in src:
            raise RuntimeError(f"the kernel's source changed; update bench.kernel_sweep: {old[:40]!r}")
        src = src.replace(old, new)
    return src


def _use_source(vector: bool) -> None:
    """Swap the kernel the engine's `paged_decode` launches (a new name: MLX caches by it)."""
    name, source = ("headroom_paged_decode_vector", vector_source()) if vector else (
        "headroom_paged_decode", cuda_decode._SOURCE)
    kernel = mx.fast.cuda_kernel(
        name=name, input_names=["q", "k_pool", "v_pool", "table", "lengths", "scale", "part"],
        output_names=["out", "out_m", "out_l"], source=source, header=cuda_decode._HEADER)
    cuda_decode._get_kernel = lambda: kernel


# name, partition sizes, target blocks, tokens per warp step, packed loads
VARIANTS = [("current", BASE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, False),
            ("vector", BASE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, True),
            ("vector_unroll8", BASE, 1056, 8, True), ("vector_unroll16", BASE, 1056, 16, True),
            ("vector_target4k", BASE, 4224, 4, True), ("vector_target4k_unroll8", BASE, 4224, 8, True),
            ("vector_fine_target4k", FINE, 4224, 4, True),
            ("target4k", BASE, 4224, 4, False), ("unroll8", BASE, 1056, 8, False),
            ("fine_target4k_unroll4", FINE, 4224, 4, False)]


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
    p.add_argument("--only", help="comma list of variant names (default: all)")
    args = p.parse_args()
    chosen = set(args.only.split(",")) if args.only else None
    for name, parts, target, unroll, vector in VARIANTS:
        if chosen is not None and name not in chosen:
            continue
        cuda_decode.PARTITIONS, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL = parts, target, unroll
        cuda_decode._launch.cache_clear()
        row: dict[str, object] = {"variant": name}
        try:
            _use_source(vector)
            row["max_abs_err"] = max(
                kernel_vs_plain(dt, b, hq, 8, d, lengths)["max_abs_err"]
                for dt, b, hq, d, lengths in ((mx.bfloat16, 5, 32, 128, [1, 17, 300, 1024, 4099]),
                                              (mx.float16, 3, 8, 64, [2, 513, 40]),
                                              (mx.float32, 64, 32, 128, ragged(64, 1000))))
            for b in (int(x) for x in args.batch.split(",")):
                row[f"b{b}"] = time_attention(b, args.context)
        except Exception as exc:  # a variant that fails to build or run: report it, go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
