"""Quantized projections that see one matrix of rows, whatever the model passes them.

A decode step hands every projection an input shaped (B, 1, K). On MLX's CUDA backend,
`mx.quantized_matmul` runs such an input as B separate one-row products, each reading the
whole weight: for a 4096×28672 4-bit matrix, 1,646 µs at B=32 against 104 µs for the same
rows shaped (B, K) (H200, MLX 0.32.4). Batched decode on 4-bit weights was 7–10× slower
than on bf16 for that reason alone. Flattening the leading dimensions before the product,
and restoring them after, gives the same numbers (every row is still its own dot
products) and reads the weight once. On Metal and the CPU it costs two reshapes (views).

`flatten_quantized(model)` swaps the class of every exact `nn.QuantizedLinear` and
`nn.QuantizedEmbedding` in place (after `engine.fusion`, whose fused copies keep their
class): parameters, their names and the weight bytes stay what they were. The MoE
experts' `gather_qmm` (mlx-lm's `QuantizedSwitchLinear`) is left as it is.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


def _flat_quantized_matmul(module: Any, x: mx.array) -> mx.array:
    lead = x.shape[:-1]
    out = mx.quantized_matmul(
        x.reshape(-1, x.shape[-1]),
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


_FLAT = {nn.QuantizedLinear: FlatQuantizedLinear, nn.QuantizedEmbedding: FlatQuantizedEmbedding}


def flatten_quantized(model: nn.Module) -> int:
    """Give every quantized projection of `model` a 2-D matmul; returns how many."""
    swapped = 0
    for _, module in model.named_modules():
        flat = _FLAT.get(type(module))
        if flat is not None:
            module.__class__ = flat
            swapped += 1
    return swapped
