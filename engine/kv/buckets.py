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

So where the backend plans per shape (`default_key_bucket`), a prefill call's keys may be
read up to `padded_keys` (filler slots beyond the real ones, masked out): powers of two
from 256 up to the bucket, then multiples of it. A 100k-token prompt then attends over 29
distinct lengths (4 powers of two, 25 multiples of 4,096), not one per chunk; the padding
costs at most a bucket of masked keys per call. The queries' length is part of the shape
too: a chunk that the step budget cuts (`engine.step_budget`) is cut to a multiple of
`QUERY_QUANTUM`. Elsewhere (Metal, the CPU) nothing is padded: their kernels are not
planned per length, and the padding would be work for nothing.

Padding is not free either: keys under an additive mask leave cuDNN's causal path, and one
layer's attention then takes 1.85–2.05× as long over 8k–98k keys (H100, 32 heads over 8 KV
heads of 128, bf16, `python -m bench.chunk_cost`: 4,096 queries over 98,304 keys 10.9 ms causal, 22.2 ms
padded; 512 queries 1.5 and 2.8 ms). Over a whole 8B model a 4,096-token chunk at 98k of
context pays about 360 ms for padding that saves one 35 ms plan. So `KeyLengths` pads a
call only where the padding costs less than a plan: small chunks, short contexts. A call
whose shape ran before attends its exact keys at no cost: a long prompt prefilled from 0
in full chunks gives the same (chunk, context) shapes every time, so its plans recur. The
plan's cost is timed by the start-up warm-up where it runs (`engine.kv.plan_probe`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

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
# What a new shape's plan costs, and how fast causal attention runs once planned (H100 and
# H200, bf16, 512 queries or more; `bench.chunk_cost` measured 550–630 TFLOP/s), and the
# share of the causal time that padding under an additive mask adds (0.85–1.05 measured at
# 512–4,096 queries over 32k–98k keys). CUDA_PLAN_MS stands where the warm-up does not run.
CUDA_PLAN_MS = 35.0
ATTENTION_FLOP_S = 6.0e14
PADDING_OVERHEAD = 0.9
PLANNED_SHAPES = 192  # below MLX's own cache of 256 cuDNN graphs (MLX_CUDA_SDPA_CACHE_SIZE)
# A call of fewer queries than this always pads: speculative verification sends a few
# queries a row at a new context every step (a plan per step if exact), and below 128
# queries what padding costs was not measured.
EXACT_MIN_QUERIES = 128


def default_plan_ms(backend: str) -> float:
    """What a new attention shape's plan costs on a backend: 0 where nothing is planned."""
    return CUDA_PLAN_MS if backend == "cuda" else 0.0


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


@dataclass
class KeyLengths:
    """The key length of each prefill call whose rows attend causally: padded to
    `padded_keys` or exact, whichever costs less (see the module docstring).

    `pair_flops` is attention's work per (query, key) pair over all layers (4 × query heads
    × head dim × layers), 0 where unknown: then a call is always padded (where `bucket` pads
    at all); `plan_ms` what a new shape's plan costs."""

    bucket: int = 0
    pair_flops: int = 0
    plan_ms: float = 0.0
    plan_measured: bool = False  # `plan_ms` was timed on this machine (engine.kv.plan_probe)
    exact_calls: int = 0  # calls that attended exact keys where the bucket would have padded
    padded_calls: int = 0
    planned_ahead: int = 0  # shapes planned while the chunk before ran (engine.kv.plan_ahead)
    _planned: OrderedDict[tuple[int, int, int], None] = field(default_factory=OrderedDict, repr=False)

    def keys(self, queries: int, end: int, rows: int = 1) -> int:
        """The keys a call of `rows` × `queries` queries ending at position `end` attends."""
        padded = padded_keys(end, self.bucket)
        if padded == end or self.is_planned(queries, end, rows):
            return end
        if rows * queries < EXACT_MIN_QUERIES:
            return padded
        return end if self.padding_ms(queries, end, rows) > self.plan_ms else padded

    def call_keys(self, queries: int, end: int, rows: int = 1, *, ragged: bool = False) -> int:
        """The keys of a call of `rows` rows of up to `queries` queries ending at most at
        `end`: `keys` where the rows are of one shape (causal); padded where they differ,
        whose mask is an array anyway."""
        return padded_keys(end, self.bucket) if ragged else self.keys(queries, end, rows)

    def padding_ms(self, queries: int, end: int, rows: int = 1) -> float:
        """What padding `end` keys adds to the call; below QUERY_FLOOR queries the card is
        not filled and a call costs what QUERY_FLOOR queries cost."""
        work = self.pair_flops * max(rows * queries, QUERY_FLOOR) * end
        return PADDING_OVERHEAD * work / ATTENTION_FLOP_S * 1e3

    def ahead_pays(self, queries: int, end: int, busy_ms: float) -> bool:
        """Whether planning a lone call of `queries` ending at `end` while the device is
        busy for `busy_ms` (`engine.kv.plan_ahead`) costs less than padding it: the part of
        the plan not hidden behind that time, against the padding's cost plus a new
        bucket's plan, which a padded call pays once every `bucket` keys."""
        if self.bucket <= 0 or self.plan_ms <= 0:
            return False
        unhidden = max(self.plan_ms - busy_ms, 0.0)
        return unhidden < self.padding_ms(queries, end) + self.plan_ms * queries / self.bucket

    def ran(self, queries: int, end: int, keys: int, rows: int = 1) -> None:
        """Note a call that ended at `end` and attended `keys` keys: an exact shape that the
        bucket would have padded is planned now."""
        if keys > end:
            self.padded_calls += 1
        elif keys != padded_keys(keys, self.bucket):
            self.exact_calls += 1
            self.planned(queries, keys, rows)

    def planned(self, queries: int, end: int, rows: int = 1) -> None:
        """Note that a call of this shape over its exact keys has its plan (it ran, or
        `engine.kv.plan_ahead` planned it): later calls of it attend exact keys."""
        shape = (rows, queries, end)
        self._planned[shape] = None
        self._planned.move_to_end(shape)
        while len(self._planned) > PLANNED_SHAPES:
            self._planned.popitem(last=False)

    def is_planned(self, queries: int, end: int, rows: int = 1) -> bool:
        return (rows, queries, end) in self._planned

    def report(self) -> dict[str, float | int | bool]:
        return {"bucket": self.bucket, "plan_ms": round(self.plan_ms, 3), "plan_measured": self.plan_measured,
                "exact_calls": self.exact_calls, "padded_calls": self.padded_calls,
                "planned_ahead": self.planned_ahead,
                "planned_shapes": len(self._planned)}
