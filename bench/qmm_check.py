"""The small-M quantized kernel (`engine.qmm_cuda`) checked and timed against MLX's product.

Correctness: every format the kernel takes (4- and 8-bit, groups 32/64/128), row counts
that fill a tile, part of one and several, with and without a K split, against the weight
dequantized and multiplied in float32. A row is ok when the kernel's largest difference,
relative to the largest output, is within twice MLX's own `quantized_matmul` plus bf16's
rounding. Speed: the Llama-3-8B shapes (fused q/k/v, o, fused gate/up, down, the output
head) at 1–64 rows, µs per product in a chain of products (weight copies cycled so that
none is read from L2), beside MLX's quantized product and the bf16 product of the same
shape, and the weight bytes each moves per second. `python -m bench.qmm_check --out F`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from engine import qmm_cuda

LLAMA_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
ROWS = (1, 8, 16, 32, 64)
L2_DEFEAT_BYTES = 256 << 20
CALLS = 24


def quantized(n: int, k: int, bits: int, group_size: int, copies: int = 1) -> list[tuple[mx.array, ...]]:
    out = []
    for _ in range(copies):
        w, s, b = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02, group_size, bits)
        mx.eval(w, s, b)
        out.append((w, s, b))
    return out


def check_row(n: int, k: int, bits: int, group_size: int, rows: int) -> dict:
    (w, s, b), = quantized(n, k, bits, group_size)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    ref = x.astype(mx.float32) @ mx.dequantize(w, s, b, group_size, bits).astype(mx.float32).T
    ours = qmm_cuda.small_m_qmm(x, w, s, b, bits=bits, group_size=group_size)
    theirs = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)
    top = mx.abs(ref).max().item()
    ours_err = mx.abs(ours.astype(mx.float32) - ref).max().item() / top
    mlx_err = mx.abs(theirs.astype(mx.float32) - ref).max().item() / top
    launch = qmm_cuda.plan(rows, k, n)
    return {"n": n, "k": k, "bits": bits, "group_size": group_size, "rows": rows, "split": launch.split,
            "ours_rel_err": round(ours_err, 6), "mlx_rel_err": round(mlx_err, 6),
            "ok": ours_err <= 2 * mlx_err + 8e-3}


def chain_us(product: Callable[[int], mx.array], copies: int) -> float:
    mx.eval(product(0))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        mx.eval([product(i % copies) for i in range(CALLS)])
        samples.append((time.perf_counter() - start) * 1e6 / CALLS)
    return statistics.median(samples)


def speed_rows(n: int, k: int, bits: int, group_size: int = 64) -> list[dict]:
    weight_bytes = n * k * bits // 8 + 2 * 2 * n * k // group_size
    copies = max(1, -(-L2_DEFEAT_BYTES // weight_bytes))
    qs = quantized(n, k, bits, group_size, copies)
    dense_copies = max(1, -(-L2_DEFEAT_BYTES // (2 * n * k)))
    dense = [mx.random.normal((n, k)).astype(mx.bfloat16) for _ in range(dense_copies)]
    mx.eval(dense)
    out = []
    for rows in ROWS:
        x = mx.random.normal((rows, k)).astype(mx.bfloat16)
        mx.eval(x)
        ours = chain_us(lambda i, x=x: qmm_cuda.small_m_qmm(x, *qs[i], bits=bits, group_size=group_size),
                        copies)
        theirs = chain_us(lambda i, x=x: mx.quantized_matmul(x, *qs[i], transpose=True, group_size=group_size,
                                                         bits=bits), copies)
        bf16 = chain_us(lambda i, x=x: x @ dense[i].T, dense_copies)
        out.append({"n": n, "k": k, "bits": bits, "group_size": group_size, "rows": rows,
                    "split": qmm_cuda.plan(rows, k, n).split, "ours_us": round(ours, 2),
                    "mlx_us": round(theirs, 2), "bf16_us": round(bf16, 2),
                    "ours_gb_s": round(weight_bytes / ours / 1e3, 1),
                    "mlx_gb_s": round(weight_bytes / theirs / 1e3, 1),
                    "bf16_gb_s": round(2 * n * k / bf16 / 1e3, 1),
                    "ours_vs_mlx": round(theirs / ours, 2)})
        print(json.dumps(out[-1]), flush=True)
    return out


def tune_rows(n: int, k: int, bits: int = 4, group_size: int = 64) -> list[dict]:
    """The kernel's µs at 8 and 32 rows for each warps-per-block and grid target."""
    weight_bytes = n * k * bits // 8 + 2 * 2 * n * k // group_size
    copies = max(1, -(-L2_DEFEAT_BYTES // weight_bytes))
    qs = quantized(n, k, bits, group_size, copies)
    out = []
    for rows in (8, 32, 64):
        x = mx.random.normal((rows, k)).astype(mx.bfloat16)
        for npb in (2, 4, 8):
            for target in (132, 264, 528, 1056):
                us = chain_us(lambda i, x=x, npb=npb, target=target: qmm_cuda.small_m_qmm(
                    x, *qs[i], bits=bits, group_size=group_size, npb=npb, target_blocks=target), copies)
                out.append({"n": n, "k": k, "bits": bits, "rows": rows, "npb": npb, "target": target,
                            "split": qmm_cuda.plan(rows, k, n, npb, target).split, "us": round(us, 2),
                            "gb_s": round(weight_bytes / us / 1e3, 1)})
                print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--tune", action="store_true", help="also time warps per block and grid targets")
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        print("the small-M kernel runs on CUDA only; this machine has none", file=sys.stderr)
        return 2
    checks = []
    for bits in qmm_cuda.BITS:
        for group_size in qmm_cuda.GROUP_SIZES:
            for n, k in ((512, 1024), (256, 4096)):  # the second splits K
                for rows in (1, 3, 8, 13, 32, 50, 64):
                    checks.append(check_row(n, k, bits, group_size, rows))
                    print(json.dumps(checks[-1]), flush=True)
    speed = [] if args.no_speed else [row for bits in qmm_cuda.BITS for n, k in LLAMA_SHAPES
                                      for row in speed_rows(n, k, bits)]
    tune = [row for n, k in LLAMA_SHAPES[:4] for row in tune_rows(n, k)] if args.tune else []
    if args.out:
        args.out.write_text(json.dumps({"checks": checks, "speed": speed, "tune": tune}, indent=1))
    failed = [c for c in checks if not c["ok"]]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks ok", flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
