"""Quantized KV rows: one token's keys (or values) of one head as a single row of words.

With `--kv-bits`, every slot of the store holds, per head, the affine quantization
`mx.quantize` makes of that head's `head_dim` values (the same format as mlx-lm's
`QuantizedKVCache`: groups of `group_size` along head_dim, each with a scale and a bias in
the model's dtype), laid out as one uint32 row::

    [ packed values: head_dim × bits / 32 words | scales, then biases, bit-cast to words ]

One array per layer and kind therefore stays one array: the store's slice writes, block
gathers, prefix copies and traced decode graphs move rows without knowing what they hold
(a prefix copy copies packed rows as they are). Only the two ends know: a write encodes
the new tokens (`KVQuant.encode`), and attention decodes what it gathered (`KVQuant.decode`)
into the model's dtype before the ordinary SDPA. Decoding is `mx.dequantize` on the GPUs and
the same arithmetic as elementwise ops on the CPU, where it is faster.

Sizes, per token, layer, head and kind: ``head_dim × bits / 8`` bytes of values plus
``2 × head_dim / group_size`` scales and biases of the dtype's size. For an 8B Llama-3
shape in bf16 (head_dim 128, group 64), 8 bits hold 136 bytes against bf16's 256
(0.53×), 4 bits 72 (0.28×). `memory.estimate.ModelGeometry.kv_bytes_per_token` counts
the same bytes for admission.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)  # what mx.quantize takes
_WORD = 4  # bytes of a uint32


@dataclass(frozen=True)
class KVQuant:
    bits: int
    group_size: int
    head_dim: int
    dtype: mx.Dtype  # the model's: scales and biases, and what attention reads back

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise ValueError(f"KV bits must be one of {KV_BITS}, not {self.bits}")
        if self.group_size not in KV_GROUP_SIZES:
            raise ValueError(f"KV group size must be one of {KV_GROUP_SIZES}, not {self.group_size}")
        if self.head_dim % self.group_size:
            fits = [g for g in KV_GROUP_SIZES if self.head_dim % g == 0]
            raise ValueError(
                f"KV group size {self.group_size} does not divide the model's head_dim "
                f"{self.head_dim}" + (f"; group sizes that do: {fits}" if fits else "")
            )

    @property
    def packed_words(self) -> int:
        return self.head_dim * self.bits // 32

    @property
    def groups(self) -> int:
        return self.head_dim // self.group_size

    @property
    def row_words(self) -> int:
        """uint32 words per token and head: packed values, then scales and biases."""
        return self.packed_words + 2 * self.groups * self.dtype.size // _WORD

    @property
    def row_bytes(self) -> int:
        return self.row_words * _WORD

    def encode(self, x: mx.array) -> mx.array:
        """[..., head_dim] in the model's dtype → [..., row_words] uint32."""
        packed, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        affine = mx.concatenate([scales, biases], axis=-1).view(mx.uint32)
        return mx.concatenate([packed, affine], axis=-1)

    def decode(self, rows: mx.array) -> mx.array:
        """[..., row_words] uint32 → [..., head_dim] in the model's dtype."""
        packed = rows[..., : self.packed_words]
        affine = rows[..., self.packed_words:].view(self.dtype)
        scales, biases = affine[..., : self.groups], affine[..., self.groups:]
        if mx.default_device().type == mx.cpu:
            return self._unpack(packed, scales, biases)
        return mx.dequantize(packed, scales, biases, group_size=self.group_size, bits=self.bits)

    def _unpack(self, packed: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        """`mx.dequantize`'s arithmetic (value × scale + bias, in the dtype) as elementwise
        ops, bit for bit: on the CPU they run decode attention about twice as fast
        (docs/kv-store.md)."""
        values = packed.view(mx.uint8)  # little-endian words: 8-bit values in order
        if self.bits == 4:
            values = mx.stack([values & 0xF, values >> 4], axis=-1)  # the low nibble first
        lead = packed.shape[:-1]
        q = values.reshape(*lead, self.groups, self.group_size).astype(self.dtype)
        return (q * scales[..., None] + biases[..., None]).reshape(*lead, self.head_dim)
