"""Attention masks in the form MLX's SDPA passes through without copying."""

from __future__ import annotations

import mlx.core as mx


def additive_mask(allowed: mx.array, dtype: mx.Dtype) -> mx.array:
    """`allowed` (a boolean mask, [B, 1, T, L]) as 0 / -inf in the queries' dtype.

    SDPA broadcasts a mask to every query head, [B, Hq, T, L]. A boolean one, where the
    backend takes none (CUDA), it turns into an additive one with `where`, which
    materialises that broadcast shape in every layer: for three prefill rows of 2,048
    tokens over 34,816 one call peaked 27.4 GB over its inputs on the H200, and under 40
    long prompts that ran the device out of memory (docs/throughput.md). An additive mask
    of the queries' dtype goes through as a broadcast view: B × T × L elements, built once
    per step or call (256 bytes over the inputs in that measurement).
    Callers keep at least one key per query row, so no row is all -inf."""
    return mx.where(allowed, mx.array(0, dtype), mx.array(-float("inf"), dtype))
