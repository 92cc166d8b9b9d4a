"""Prefill attention over key lengths from a small set, where each new length costs a plan.

On CUDA, MLX's fused prefill attention (cuDNN) builds an execution plan for each new shape
of its inputs and keeps it for that shape. Measured on the H200 (`mx.fast.
scaled_dot_product_attention`, 256 queries of 32 heads over 8 KV heads of 128, bf16): over
a key length seen before, 0.3–0.7 ms; over a new one, 35 ms, every time; over keys padded
up to a multiple of 4,096 under an additive mask, 0.5–1.5 ms, and 40 ms at each new
multiple. Chunked prefill gives every chunk a new key length (its context grew by the last
chunk), so every chunk paid the plan: a Llama-3-8B-shaped model prefilled a 65,536-token
prompt in 256-token chunks at 65 ms a chunk at any context, where the two chunks whose
shapes a warm-up had run took 10 ms (bare mlx-lm's own cache, which concatenates, the same).
Speculative verification, a few tokens over a growing context each step, paid it per step.

So where the backend plans per shape (`default_key_bucket`), a prefill call's keys are
gathered up to `padded_keys` (filler slots beyond the real ones, masked out): powers of two
from 256 up to the bucket, then multiples of it. A 100k-token prompt then attends over 29
distinct lengths (4 powers of two, 25 multiples of 4,096), not one per chunk; the padding
costs at most a bucket of masked keys per call. The queries' length is part of the shape
too: a chunk that the step budget cuts (`engine.step_budget`) is cut to a multiple of
`QUERY_QUANTUM`. Elsewhere (Metal, the CPU) nothing is padded: their kernels are not
planned per length, and the padding would be work for nothing.
"""

from __future__ import annotations

CUDA_KEY_BUCKET = 4096
SMALLEST = 256
QUERY_QUANTUM = 256  # a chunk the step budget cuts is a multiple of this (engine.step_budget)
# A chunk the step budget cuts is never smaller than this where keys are padded (CUDA): one
# layer's attention over a long context takes about as long for 128 queries as for 512
# (H100, 32 heads over 8 KV heads of 128, bf16; at 98,304 keys 1.42 ms causal and 2.61 ms
# padded for 128, 1.49 and 2.76 ms for 512, 2.74 and 5.11 ms for 1,024;
# `python -m bench.chunk_cost`): below it, the card is not filled, and a cut chunk saves
# the decoding streams almost nothing while the prompt gets a quarter of the tokens.
QUERY_FLOOR = 512


def default_key_bucket(backend: str) -> int:
    """The bucket for a backend: 0 (no padding) where attention is not planned per shape."""
    return CUDA_KEY_BUCKET if backend == "cuda" else 0


def padded_keys(length: int, bucket: int) -> int:
    """The key length a prefill call over `length` keys attends: `length` itself where
    `bucket` is 0; else the next power of two (at least `SMALLEST`) below the bucket, or
    the next multiple of the bucket."""
    if bucket <= 0 or length <= 0:
        return length
    small = max(SMALLEST, 1 << (length - 1).bit_length())
    if small < bucket:
        return small
    return -(-length // bucket) * bucket
