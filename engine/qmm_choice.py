"""Which quantized products take the small-M kernel: timed against MLX's on the loaded weights.

`engine.qmm_cuda` is faster than MLX 0.32's product at the row counts of a decode batch
on the cards it was measured on, but not necessarily at every shape, row count and card
(MLX's own one-row kernel is good at one row). So at load, on CUDA, each distinct weight
shape and format of the model is timed both ways at a few row counts (`POINTS`) on one of
its own weights, and a product of r rows takes the kernel where it won at the smallest
point ≥ r, and only where its numbers agreed with MLX's. This also compiles every kernel
variant the model will use, so no request meets an NVRTC compile.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine import qmm_cuda

log = logging.getLogger(__name__)

POINTS = (1, 8, 16, 32, 64)
CALLS = 8  # products per timed chain: the host's launch cost hides behind the device's work
CHAINS = 5
AGREE = 0.02  # largest difference, relative to the largest output, still called the same product


@dataclass(frozen=True)
class ShapeChoice:
    """One weight shape and format, timed: µs per product at each point, both ways."""

    out_features: int
    in_features: int
    bits: int
    group_size: int
    ours_us: tuple[float, ...]
    mlx_us: tuple[float, ...]

    @property
    def points(self) -> frozenset[int]:
        return frozenset(p for p, a, b in zip(POINTS, self.ours_us, self.mlx_us, strict=True) if a < b)


def point_for(rows: int) -> int:
    """The smallest timed point that covers `rows` (rows ≤ qmm_cuda.MAX_ROWS)."""
    return next(p for p in POINTS if p >= rows)


def _chain_us(product: Callable[[], mx.array]) -> float:
    mx.eval(product())
    samples = []
    for _ in range(CHAINS):
        start = time.perf_counter()
        mx.eval([product() for _ in range(CALLS)])
        samples.append((time.perf_counter() - start) * 1e6 / CALLS)
    return statistics.median(samples)


def time_shape(module: nn.Module) -> ShapeChoice:
    """Time `module`'s own weight through both products at every point."""
    w, s, b = module["weight"], module["scales"], module["biases"]
    n, k = w.shape[0], w.shape[1] * 32 // module.bits
    ours, theirs = [], []
    for rows in POINTS:
        x = mx.random.normal((rows, k)).astype(mx.bfloat16)
        mx.eval(x)

        def kernel(x: mx.array = x) -> mx.array:
            return qmm_cuda.small_m_qmm(x, w, s, b, bits=module.bits, group_size=module.group_size)

        def reference(x: mx.array = x) -> mx.array:
            return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=module.group_size,
                                       bits=module.bits)

        agrees = _agrees(kernel(), reference())
        ours.append(_chain_us(kernel) if agrees else math.inf)
        theirs.append(_chain_us(reference))
        if not agrees:
            log.warning("small-M quantized product %dx%d %d-bit g%d disagrees with MLX's at %d rows: "
                        "not taken", n, k, module.bits, module.group_size, rows)
    return ShapeChoice(n, k, module.bits, module.group_size, tuple(ours), tuple(theirs))


def _agrees(ours: mx.array, theirs: mx.array) -> bool:
    """Equal up to bf16 rounding and summation order, relative to the largest output."""
    top = mx.abs(theirs).max().item()
    return mx.abs(ours.astype(mx.float32) - theirs.astype(mx.float32)).max().item() <= AGREE * max(top, 1e-6)


def eligible(module: nn.Module) -> bool:
    """A flattened dense projection (or tied head) whose format and shape the kernel takes,
    with bf16 scales (the rows are then bf16 too)."""
    if not hasattr(module, "small_m_points") or "weight" not in module:
        return False
    w = module["weight"]
    return (w.ndim == 2 and module["scales"].dtype == mx.bfloat16 and qmm_cuda.supports(
        bits=module.bits, group_size=module.group_size, mode=module.mode,
        in_features=w.shape[1] * 32 // module.bits, out_features=w.shape[0],
        has_biases=module.get("biases") is not None))


def choose_small_m(model: nn.Module) -> list[ShapeChoice]:
    """Time each distinct eligible shape once, and set every eligible module's
    `small_m_points` to the points where the kernel won. Returns the timings."""
    by_shape: dict[tuple[int, ...], ShapeChoice] = {}
    for _, module in model.named_modules():
        if not eligible(module):
            continue
        key = (*module["weight"].shape, module.bits, module.group_size)
        if key not in by_shape:
            by_shape[key] = time_shape(module)
        module.small_m_points = by_shape[key].points
    for c in by_shape.values():
        log.info("small-M quantized product %dx%d %d-bit g%d: ours %s µs, MLX %s µs at rows %s",
                 c.out_features, c.in_features, c.bits, c.group_size,
                 "/".join(f"{v:.0f}" for v in c.ours_us), "/".join(f"{v:.0f}" for v in c.mlx_us),
                 "/".join(map(str, POINTS)))
    return list(by_shape.values())
