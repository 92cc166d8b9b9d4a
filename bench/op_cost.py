"""What one MLX op costs the host, on this device: the unit a decode step's op count is paid in.

    python -m bench.op_cost

A chain of N tiny elementwise ops (the device's share is a few microseconds each, so the
time is MLX's building, encoding and launching), a chain of N view ops (reshape and
transpose: no kernel), and N one-row matmuls of an 8B model's q/k/v shapes, three
separate against one fused, so the fusion's saving per layer is measured directly.
Prints one JSON line; microseconds per op, best of a few repeats.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import mlx.core as mx


def per_op_us(build: Callable[[], mx.array], ops: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        out = build()
        mx.eval(out)
        best = min(best, time.perf_counter() - started)
    return round(best / ops * 1e6, 2)


def main() -> None:
    n = 2000
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    small = mx.ones((1, 4096), dtype)
    mx.eval(small)

    def adds() -> mx.array:
        y = small
        for _ in range(n):
            y = y + small
        return y

    def views() -> mx.array:
        y = small
        for _ in range(n // 2):
            y = y.reshape(1, 32, 128).transpose(0, 2, 1).transpose(0, 2, 1).reshape(1, 4096)
        return y + small  # one kernel, so the views are evaluated

    x = mx.ones((1, 1, 4096), dtype)
    wq, wk, wv = (mx.random.normal((rows, 4096)).astype(dtype) * 0.01 for rows in (4096, 1024, 1024))
    wqkv = mx.concatenate([wq, wk, wv], axis=0)
    mx.eval(x, wq, wk, wv, wqkv)
    layers = 64

    def separate() -> list[mx.array]:
        return [y for _ in range(layers) for y in (x @ wq.T, x @ wk.T, x @ wv.T)]

    def fused() -> list[mx.array]:
        return [y for _ in range(layers) for y in mx.split(x @ wqkv.T, [4096, 5120], axis=-1)]

    out = {"device": str(mx.default_device()), "add_us": per_op_us(adds, n),
           "view_us": per_op_us(views, 2 * n),
           "qkv_separate_us_per_layer": per_op_us(separate, layers),
           "qkv_fused_us_per_layer": per_op_us(fused, layers)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
