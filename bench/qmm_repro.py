"""Quantized products on a decode step's (B, 1, K) input against the same rows as (B, K).

A language model's decode step hands every projection one token per sequence, shaped
(B, 1, K). On MLX's CUDA backend `mx.quantized_matmul` runs that as B separate one-row
products, each reading the whole weight, where the same data shaped (B, K) is one product
that reads it once: on an H200 (MLX 0.32.4), a 4096×28672 4-bit weight took 87 / 414 /
1,646 / 3,228 µs at B = 1 / 8 / 32 / 64 as (B, 1, K) against 67 / 59 / 104 / 124 µs as
(B, K), so batched decode of 4-bit models grows linearly in B. A mixture of experts' layer
calls `mx.gather_qmm` with mlx-lm's SwitchGLU shapes: x (B, 1, 1, 1, K) and indices
(B, 1, k) under 64 routed rows, or one row per routed token, (B·k, 1, K) against (B·k,)
indices sorted by expert, from 64 rows up. This script times both operations in each
form on the default device and prints microseconds and the weight bytes each call needs
divided by its time (GB/s; for the experts, the bytes of the distinct experts the indices
select). A third table times prefill-sized products (M rows at once): the quantized
product, the weight dequantized then multiplied, and the unquantized weight. Each row is
also printed to stderr as it is measured (the first call of each shape may compile for
long on CUDA). It imports nothing but MLX: `python bench/qmm_repro.py`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import mlx.core as mx


def timed_us(fn: Callable[[], mx.array], iters: int, warmup: int) -> float:
    """Median wall time of one evaluated call, in microseconds."""
    for _ in range(warmup):
        mx.eval(fn())
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def quantize(w: mx.array, args: argparse.Namespace) -> tuple[mx.array, mx.array, mx.array | None]:
    weight, scales, *biases = mx.quantize(w, args.group_size, args.bits, mode=args.mode)
    return weight, scales, (biases[0] if biases else None)


def nbytes(*arrays: mx.array | None) -> int:
    return sum(a.nbytes for a in arrays if a is not None)


def dense_rows(args: argparse.Namespace) -> list[list[str]]:
    w, s, b = quantize(mx.random.normal((args.n, args.k)).astype(args.dtype), args)
    mx.eval(w, s, b)
    weight_bytes = nbytes(w, s, b)

    def product(x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=args.group_size,
                                   bits=args.bits, mode=args.mode)

    rows = []
    for batch in args.batches:
        x = mx.random.normal((batch, 1, args.k)).astype(args.dtype)
        flat = x.reshape(batch, args.k)
        mx.eval(x, flat)
        us_3d = timed_us(partial(product, x), args.iters, args.warmup)
        us_2d = timed_us(partial(product, flat), args.iters, args.warmup)
        keep(rows, [str(batch), f"{us_3d:,.0f}", f"{us_2d:,.0f}", f"{us_3d / us_2d:.1f}",
                     gbps(weight_bytes, us_3d), gbps(weight_bytes, us_2d)])
    return rows


def prefill_rows(args: argparse.Namespace) -> list[list[str]]:
    """Many rows at once (a prefill chunk): the quantized product against the same weight
    dequantized first and multiplied as bf16, and against the original bf16 weight."""
    dense = mx.random.normal((args.n, args.k)).astype(args.dtype)
    w, s, b = quantize(dense, args)
    mx.eval(dense, w, s, b)

    def quantized(x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=args.group_size,
                                   bits=args.bits, mode=args.mode)

    def dequantized(x: mx.array) -> mx.array:
        full = mx.dequantize(w, s, b, group_size=args.group_size, bits=args.bits, mode=args.mode)
        return x @ full.astype(x.dtype).T

    def unquantized(x: mx.array) -> mx.array:
        return x @ dense.T

    rows = []
    for m in args.prefill_rows:
        x = mx.random.normal((m, args.k)).astype(args.dtype)
        mx.eval(x)
        us = [timed_us(partial(f, x), args.iters, args.warmup) for f in (quantized, dequantized, unquantized)]
        tflops = [2 * m * args.k * args.n / t / 1e6 for t in us]
        keep(rows, [str(m), *(f"{t:,.0f}" for t in us), *(f"{t:,.0f}" for t in tflops)])
    return rows


def expert_rows(args: argparse.Namespace) -> list[list[str]]:
    d, e, k = args.expert_dims, args.experts, args.top_k
    w, s, b = quantize(mx.random.normal((e, d, d)).astype(args.dtype), args)
    mx.eval(w, s, b)
    per_expert = nbytes(w, s, b) / e
    def gather(x: mx.array, idx: mx.array, lhs: mx.array | None = None,
               sorted_indices: bool = False) -> mx.array:
        return mx.gather_qmm(x, w, s, b, lhs_indices=lhs, rhs_indices=idx, transpose=True,
                             group_size=args.group_size, bits=args.bits, mode=args.mode,
                             sorted_indices=sorted_indices)

    rows = []
    for batch in args.batches:
        x = mx.random.normal((batch, 1, d)).astype(args.dtype)
        indices = mx.argpartition(mx.random.uniform(shape=(batch, e)), kth=k, axis=-1)[:, :k]
        indices = indices.astype(mx.uint32)
        flat = indices.reshape(-1)
        order = mx.argsort(flat)
        x_sorted = x[order // k]  # what mlx-lm's _gather_sort hands the product
        mx.eval(x, indices, order, x_sorted)
        experts_read = len(set(flat.tolist())) * per_expert

        lhs = mx.repeat(mx.arange(batch, dtype=mx.uint32), k)
        sorted_flat = flat[order]
        mx.eval(lhs, sorted_flat)
        forms = [  # mlx-lm's shapes under 64 routed rows; one row per routed token; sorted
            partial(gather, x.reshape(batch, 1, 1, 1, d), indices.reshape(batch, 1, k)),
            partial(gather, x, flat, lhs),
            partial(gather, x_sorted, sorted_flat, sorted_indices=True),
        ]
        us = [timed_us(f, args.iters, args.warmup) for f in forms]
        keep(rows, [str(batch), *(f"{t:,.0f}" for t in us),
                     *(gbps(experts_read, t) for t in us)])
    return rows


def gbps(nbytes: float, us: float) -> str:
    rate = nbytes / us / 1e3
    return f"{rate:,.1f}" if rate >= 10 else f"{rate:.3f}"


def keep(rows: list[list[str]], row: list[str]) -> None:
    """Add a table row, and print it to stderr at once: on a backend that compiles each new
    shape on first use, a run cut short by a timeout still shows what it measured."""
    rows.append(row)
    print("  ".join(row), file=sys.stderr, flush=True)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")],
                        default=[1, 8, 32, 64])
    parser.add_argument("--prefill-rows", type=lambda v: [int(b) for b in v.split(",")],
                        default=[128, 512, 2048, 8192])
    parser.add_argument("--k", type=int, default=4096, help="input dims of the dense weight")
    parser.add_argument("--n", type=int, default=28672, help="output dims of the dense weight")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-dims", type=int, default=2880, help="each expert is d × d")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--mode", default="affine", help="affine, mxfp4 (group 32), nvfp4, mxfp8")
    parser.add_argument("--dtype", default="bfloat16",
                        help="activations and weights before quantizing (float32 on a CPU)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    args.dtype = getattr(mx, args.dtype)

    print(f"MLX {mx.__version__}, device {mx.default_device()}, {args.bits}-bit {args.mode}, "
          f"group {args.group_size}, {args.dtype}")
    print(f"\nmx.quantized_matmul, weight {args.n}×{args.k}: µs per call, GB/s of weight read")
    print(table(["B", "(B,1,K) µs", "(B,K) µs", "ratio", "(B,1,K) GB/s", "(B,K) GB/s"],
                dense_rows(args)))
    print(f"\nPrefill rows, weight {args.n}×{args.k}: quantized_matmul, dequantize then matmul, "
          "the unquantized weight; µs per call, then TFLOP/s")
    print(table(["M", "qmm µs", "dequant+mm µs", "bf16 µs", "qmm TF/s", "dequant+mm TF/s", "bf16 TF/s"],
                prefill_rows(args)))
    print(f"\nmx.gather_qmm, {args.experts} experts of {args.expert_dims}×{args.expert_dims}, "
          f"top {args.top_k}: µs per call, GB/s of the selected experts' weights")
    print(table(["B", "(B,1,1,1,K) µs", "rows µs", "rows sorted µs",
                 "(B,1,1,1,K) GB/s", "rows GB/s", "sorted GB/s"], expert_rows(args)))


if __name__ == "__main__":
    main()
