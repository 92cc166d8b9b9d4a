"""Does the CUDA paged decode kernel give what the plain-MLX path gives, on every variant?

The kernel (`engine.kv.cuda_decode`) runs on CUDA only, so its tests here compile it
(`tests/engine/test_kernel_compile.py`) and record its launches; this script runs it. On
random pools addressed through real block tables of the engine's store, it compares the
kernel with `engine.kv.attention.plain_decode` for full layers, window layers whose rings
have wrapped (`memory.paged`), and both with gpt-oss's sink logits, at two head shapes,
and on 8- and 4-bit quantized KV (`engine.kv.quant`), and times each path at a batch of 32:

    python -m bench.kernel_check                  # on a CUDA machine; prints one line per case
    python -m bench.kernel_check --out check.json

It exits non-zero when any case differs by more than the tolerance of the dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

from engine.kv import KVGeometry, KVStore, plan_decode
from engine.kv.attention import plain_decode
from engine.kv.cuda_decode import paged_decode

WINDOW = 1024
CHUNK = 512
LENGTHS = (1, 17, 600, 1023, 1024, 1025, 1600, 3000, 5000)  # rows' positions, past the ring's wrap
TOLERANCE = {mx.bfloat16: 2e-2, mx.float16: 5e-3, mx.float32: 1e-4}


def _store(kv_heads: int, head_dim: int, dtype: mx.Dtype, batch: int,
           kv_bits: int | None = None) -> tuple[KVStore, list]:
    geometry = KVGeometry(2, kv_heads, head_dim, dtype, windows=(WINDOW, None), kv_bits=kv_bits)
    store = KVStore(geometry, segment_tokens=batch * 8192, chunk_tokens=CHUNK)
    allocs = []
    for i in range(batch):
        position = LENGTHS[i % len(LENGTHS)] + i
        alloc = store.reserve(f"r{i}", position + 16)
        alloc.length = position  # the new token's position: the step attends position + 1 keys
        allocs.append(alloc)
    (segment,) = store.segments.values()
    quant = geometry.quant
    shape = (*segment.keys[0].shape[:2], head_dim)

    def rows() -> mx.array:
        x = mx.random.normal(shape).astype(dtype)
        return x if quant is None else quant.encode(x)

    segment.keys = [rows() for _ in segment.keys]
    segment.values = [rows() for _ in segment.values]
    mx.eval(segment.keys, segment.values)
    return store, allocs


def _timed(fn: object, repeats: int = 20) -> tuple[mx.array, float]:
    out = fn()  # type: ignore[operator]
    mx.eval(out)
    started = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())  # type: ignore[operator]
    return out, (time.perf_counter() - started) / repeats * 1e3


def check(q_heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, batch: int,
          kv_bits: int | None = None) -> list[dict]:
    store, allocs = _store(kv_heads, head_dim, dtype, batch, kv_bits)
    quant = store.geometry.quant
    plan = plan_decode(store, allocs)
    q = mx.random.normal((batch, q_heads, 1, head_dim)).astype(dtype)
    sinks = mx.random.normal((q_heads,)).astype(dtype)
    scale = head_dim ** -0.5
    rows = []
    for name, groups in (("full", plan.groups), ("window", plan.more[0])):
        (g,) = groups
        keys, values = g.segment.keys[0], g.segment.values[0]
        for with_sinks in (False, True):
            s = sinks if with_sinks else None

            def kernel_path(g=g, keys=keys, values=values, s=s) -> mx.array:
                return paged_decode(q, keys, values, g.table, g.lengths, g.max_length, scale,
                                    store.block_size, window=g.window, ring=g.ring_blocks, sinks=s,
                                    quant=quant)

            def plain_path(g=g, keys=keys, values=values, s=s) -> mx.array:
                return plain_decode(q, keys, values, g, scale, store.block_size, quant, sinks=s)

            kernel, kernel_ms = _timed(kernel_path)
            plain, plain_ms = _timed(plain_path)
            diff = float(mx.abs(kernel.astype(mx.float32) - plain.astype(mx.float32)).max())
            rows.append({"layer": name, "sinks": with_sinks, "q_heads": q_heads, "kv_heads": kv_heads,
                         "head_dim": head_dim, "dtype": str(dtype), "batch": batch, "kv_bits": kv_bits,
                         "max_abs_diff": diff, "ok": diff <= TOLERANCE[dtype],
                         "kernel_ms": round(kernel_ms, 3), "plain_ms": round(plain_ms, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not mx.cuda.is_available():
        print("the paged kernel runs on CUDA only; this machine has none", file=sys.stderr)
        return 2
    rows = []
    cases = [(16, 8, 256, None), (32, 8, 128, None), (32, 8, 128, 8), (32, 8, 128, 4)]
    for q_heads, kv_heads, head_dim, kv_bits in cases:  # Gemma 3 12B, Llama 3 8B, its quantized KV
        for batch in (1, 32):
            for row in check(q_heads, kv_heads, head_dim, mx.bfloat16, batch, kv_bits):
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
