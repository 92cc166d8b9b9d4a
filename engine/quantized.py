"""Quantized projections that see one matrix of rows, whatever the model passes them.

A decode step hands every projection an input shaped (B, 1, K). On MLX's CUDA backend,
`mx.quantized_matmul` runs such an input as B separate one-row products, each reading the
whole weight: for a 4096×28672 4-bit matrix, 1,646 µs at B=32 against 104 µs for the same
rows shaped (B, K) (H200, MLX 0.32.4). Batched decode on 4-bit weights was 7–10× slower
than on bf16 for that reason alone. Flattening the leading dimensions before the product,
and restoring them after, gives the same numbers (every row is still its own dot
products) and reads the weight once. On Metal and the CPU it costs two reshapes (views).

`flatten_quantized(model)` swaps the class of every exact `nn.QuantizedLinear`,
`nn.QuantizedEmbedding` and mlx-lm's `QuantizedSwitchLinear` (the MoE experts) in place
(after `engine.fusion`, whose fused copies keep their class): parameters, their names and
the weight bytes stay what they were. Every quantization mode goes through unchanged
(affine, mxfp4, nvfp4 with its global scale).

Many rows (a prefill chunk) are the opposite case. MLX's CUDA quantized product is slow
there: bare mlx-lm prefilled a Llama-3-8B shape at 9,079 tok/s in 4-bit against 43,716 in
bf16 on the H200 (bench/results/2026-12-04-h200-quantized), and the served 4-bit model's
throughput at C=64 (1,112 tok/s) is what its 64 prompts' prefill at that rate plus the
flattened decode step leave. So from `dequantize_rows` rows up (CUDA only,
`default_dequantize_rows`), a dense projection dequantizes its weight to the activations'
dtype and multiplies that, as vLLM's AWQ layers do from 256 tokens: the extra reads and
writes of one bf16 copy of the weight are small beside a chunk's compute, and the copy is
a transient of one projection at a time, which the prefill estimate counts
(`largest_dequantized_bytes`, `ModelGeometry.prefill_weight_bytes`). Not the output head:
it meets many rows only when a prompt is scored, and would be by far the largest copy. The
crossover on a given card is what `bench/qmm_repro.py` prints under "Prefill rows".

Few rows (a decode batch) on CUDA: where `engine.qmm_choice` timed it faster at load, a
dense projection takes `engine.qmm_cuda`'s small-M kernel, which reads the weight once on
tensor cores; MLX's product moves 530–630 GB/s of weights at 32–64 rows.

The experts' `mx.gather_qmm` takes x shaped (..., M, K) and one expert index per batch
element: SwitchGLU hands it x as (B, L, 1, 1, K) with indices (B, L, k) in a decode step
(fewer than 64 routed rows), or (N, 1, K) with indices (N,) sorted by expert (64 or more).
The flat form is the second: one row per routed token, one index each. Reaching it from
the first needs `lhs_indices` (row i of x for every expert it is routed to), which MLX's
own default builds the same way; but a call given `lhs_indices` is never treated as
sorted on the right (`right_sorted = sorted_indices and lhs_indices is None`, mlx/ops.cpp),
so sorted calls keep x as it comes and pass no `lhs_indices`. Unlike `quantized_matmul`,
this changes no CUDA kernel's work in MLX 0.32 (`GatherQMM::eval_gpu` counts the batch as
out.size / (M·N) either way): every routed row is its own one-row product against its
expert's weight by gather_qmm's definition; only Metal's sorted kernel (`gather_qmm_rhs`)
reads one expert's weight once for the rows routed to it. The flat form is what such a
kernel takes, and what bench/qmm_repro.py shows MLX's maintainers.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from engine import qmm_cuda
from engine.qmm_choice import point_for


def _flat_quantized_matmul(module: Any, x: mx.array) -> mx.array:
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    threshold = getattr(module, "dequantize_rows", 0)
    points = getattr(module, "small_m_points", None)
    if (points and rows.shape[0] <= qmm_cuda.MAX_ROWS and x.dtype == mx.bfloat16
            and point_for(rows.shape[0]) in points):
        out = qmm_cuda.small_m_qmm(rows, module["weight"], module["scales"], module["biases"],
                                   bits=module.bits, group_size=module.group_size)
    elif threshold and rows.shape[0] >= threshold:
        weight = mx.dequantize(
            module["weight"], module["scales"], module.get("biases"), group_size=module.group_size,
            bits=module.bits, mode=module.mode, global_scale=module.get("global_scale"), dtype=x.dtype,
        )
        out = rows @ weight.T
    else:
        out = mx.quantized_matmul(
            rows,
            module["weight"],
            scales=module["scales"],
            biases=module.get("biases"),
            transpose=True,
            group_size=module.group_size,
            bits=module.bits,
            mode=module.mode,
        )
    return out.reshape(*lead, out.shape[-1])


class FlatQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        out = _flat_quantized_matmul(self, x)
        if "bias" in self:
            out = out + self["bias"]
        return out


class FlatQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        """The tied output head: (B, 1, hidden) in a decode step, like any projection."""
        return _flat_quantized_matmul(self, x)


def _flat_gather_qmm(module: Any, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
    """`gather_qmm` on rows: x as (rows of x, M, K), one expert index per routed row."""
    batch = tuple(mx.broadcast_shapes(x.shape[:-2], indices.shape))
    x_batch = tuple(x.shape[:-2])
    lhs: mx.array | None = None
    if x_batch != batch:
        if sorted_indices:  # lhs_indices would turn the sorted kernel off: leave it as it is
            return _gather_qmm(module, x, None, indices, sorted_indices)
        lhs = mx.broadcast_to(mx.arange(math.prod(x_batch), dtype=mx.uint32).reshape(x_batch),
                              batch).reshape(-1)
    rows = x.reshape(-1, *x.shape[-2:])
    out = _gather_qmm(module, rows, lhs, mx.broadcast_to(indices, batch).reshape(-1), sorted_indices)
    return out.reshape(*batch, *out.shape[-2:])


def _gather_qmm(module: Any, x: mx.array, lhs: mx.array | None, rhs: mx.array,
                sorted_indices: bool) -> mx.array:
    return mx.gather_qmm(
        x,
        module["weight"],
        module["scales"],
        module.get("biases"),
        lhs_indices=lhs,
        rhs_indices=rhs,
        transpose=True,
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
        global_scale=module.global_scale,
        sorted_indices=sorted_indices,
    )


class FlatQuantizedSwitchLinear(QuantizedSwitchLinear):
    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        out = _flat_gather_qmm(self, x, indices, sorted_indices)
        if "bias" in self:
            out = out + mx.expand_dims(self["bias"][indices], -2)
        return out


CUDA_DEQUANTIZE_ROWS = 256  # vLLM's AWQ layers switch at the same count


def default_dequantize_rows(backend: str) -> int:
    """From how many rows a dense quantized projection dequantizes on `backend` (0: never)."""
    return CUDA_DEQUANTIZE_ROWS if backend == "cuda" else 0


# a prefill call's logits are never evaluated unless its prompt is scored
OUTPUT_HEADS = frozenset({"lm_head", "output"})

_FLAT: dict[type, type] = {
    nn.QuantizedLinear: FlatQuantizedLinear,
    nn.QuantizedEmbedding: FlatQuantizedEmbedding,
    QuantizedSwitchLinear: FlatQuantizedSwitchLinear,
}


def flatten_quantized(model: nn.Module, *, dequantize_rows: int = 0) -> int:
    """Give every quantized projection of `model` a 2-D matmul; returns how many.
    `dequantize_rows`: from this many rows up, a dense projection (not the experts')
    dequantizes its weight and multiplies in the activations' dtype (0: never)."""
    swapped = 0
    for name, module in model.named_modules():
        flat = _FLAT.get(type(module))
        if flat is not None:
            module.__class__ = flat
            swapped += 1
        if isinstance(module, FlatQuantizedLinear):
            module.dequantize_rows = 0 if name.rsplit(".", 1)[-1] in OUTPUT_HEADS else dequantize_rows
        if isinstance(module, FlatQuantizedLinear | FlatQuantizedEmbedding):
            module.small_m_points = frozenset()  # `engine.qmm_choice.choose_small_m` fills it on CUDA
    return swapped


def largest_dequantized_bytes(model: nn.Module, dtype_bytes: int) -> int:
    """The largest weight a dequantizing projection of `model` materialises, in bytes: the
    transient a prefill call holds beside its activations (one projection at a time)."""
    largest = 0
    for _, module in model.named_modules():
        if getattr(module, "dequantize_rows", 0):
            rows, packed = module["weight"].shape[-2:]
            largest = max(largest, rows * packed * 32 // module.bits * dtype_bytes)
    return largest
