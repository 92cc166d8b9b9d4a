"""How many bytes a model's weights take, without loading them.

The exact number comes from the safetensors headers: each tensor's dtype, shape and byte
range are in the JSON header at the start of every file, so summing them reads a few
kilobytes per shard however large the model is. Quantized tensors (mlx-lm packs them as
``uint32`` words beside ``scales`` and, for affine, ``biases``; the microscaling modes
mxfp4, nvfp4 and mxfp8 keep one ``uint8`` scale per group and no biases) are counted at
their packed size, and so are gpt-oss's original ``*_blocks`` / ``*_scales`` experts.

A :class:`WeightInventory` also knows which elements mlx-lm *could* quantize (2-D weights
whose last dimension is a multiple of the group size, the rule ``nn.quantize`` applies), so
it can say what the same model would take at 8 or 4 bits: the "smaller quantisation" a
refused load suggests.

Pure: parsing takes the header's bytes; opening files is the caller's job.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_GROUP_SIZE = 64  # mlx-lm's default quantization group
# Projections that read the same input, fused into one matmul at load (engine.fusion):
# loading holds one group's weights twice while its concatenation is built.
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
SCALE_BYTES = 2  # scales and biases are stored in the model's 16-bit dtype
# Microscaling modes (uint8 scales) allow one (bits, group size) each (mlx_lm.utils
# infer_quant_config); uint32 words per scale tell them apart: group × bits / 32.
_MICROSCALING_GROUP = {2: 16, 4: 32, 8: 32}  # nvfp4, mxfp4, mxfp8


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a file (or a lazily built model) describes it."""

    name: str
    dtype: str  # safetensors spelling ("BF16", "U32", ...) or an MLX dtype name
    shape: tuple[int, ...]
    nbytes: int

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Quantization:
    """A model's quantization as its config states it: the default, and the layers that
    mlx-lm's converter quantized otherwise (gpt-oss's router at 8 bits, experts in mxfp4
    beside affine 8-bit attention), keyed by module path."""

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE
    mode: str = "affine"
    layers: tuple[tuple[str, Quantization], ...] = field(default=(), repr=False)

    def for_layer(self, path: str) -> Quantization:
        return next((q for p, q in self.layers if p == path), self)

    def __str__(self) -> str:
        own = _describe(self)
        others = sorted({_describe(q) for _, q in self.layers} - {own})
        return own + "".join(f", some layers {o}" for o in others)


def _describe(q: Quantization) -> str:
    if q.mode == "affine":
        return f"{q.bits}-bit (group {q.group_size})"
    return f"{q.mode} ({q.bits}-bit, group {q.group_size})"


@dataclass(frozen=True)
class WeightInventory:
    """Weight bytes as stored, split into what quantization would shrink and what it keeps."""

    total_bytes: int
    quantizable_elements: int  # logical elements of quantizable (or quantized) matrices
    quantizable_bytes: int  # their bytes as stored now (packed words + scales + biases)
    quantization: Quantization | None = None  # the model's own, if quantized
    largest_fused_group_bytes: int = 0  # the most one projection group takes (FUSED_GROUPS)

    @property
    def other_bytes(self) -> int:
        """Norms, biases, and matrices quantization leaves alone."""
        return self.total_bytes - self.quantizable_bytes

    def bytes_at(self, quantization: Quantization) -> int:
        """Weight bytes if the quantizable matrices were stored at ``quantization``."""
        n = self.quantizable_elements
        packed = math.ceil(n * quantization.bits / 8)
        groups = math.ceil(n / quantization.group_size)
        return self.other_bytes + packed + 2 * groups * SCALE_BYTES


def parse_safetensors_header(data: bytes) -> list[TensorInfo]:
    """Tensors listed in a safetensors header: ``data`` holds at least the 8-byte length and
    the JSON header that follows it. Raises ``ValueError`` for anything malformed."""
    if len(data) < 8:
        raise ValueError("not a safetensors file: shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", data[:8])
    if len(data) < 8 + length:
        raise ValueError(f"safetensors header is {length} bytes but only {len(data) - 8} given")
    try:
        header: dict[str, Any] = json.loads(data[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"safetensors header is not JSON: {exc}") from exc
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        tensors.append(TensorInfo(name, str(entry["dtype"]), tuple(entry["shape"]), int(end - start)))
    return tensors


def safetensors_header_length(prefix: bytes) -> int:
    """Bytes to read from the file's start to hold the whole header (8 + its length)."""
    (length,) = struct.unpack("<Q", prefix[:8])
    return 8 + int(length)


def inventory_from_tensors(
    tensors: Iterable[TensorInfo], quantization: Quantization | None = None
) -> WeightInventory:
    """Sum ``tensors`` and find the quantizable matrices.

    A quantized matrix ``X.weight`` comes with ``X.scales`` (one per group): its logical
    element count is scales × group size, the group being the layer's own (uint8 scales
    name their microscaling mode by their shape; affine ones take the config's entry for
    ``X``, else its default). gpt-oss's original ``X_blocks`` hold two mxfp4 values per
    byte. An unquantized 2-D ``.weight`` whose last dimension divides by the group size is
    what ``nn.quantize`` would quantize (linear layers and embeddings; norms are 1-D).
    """
    by_name = {t.name: t for t in tensors}
    total = sum(t.nbytes for t in by_name.values())
    q_elements = 0
    q_bytes = 0
    for name, t in by_name.items():
        if name.endswith("_blocks") and (block_scales := by_name.get(name[: -len("_blocks")] + "_scales")):
            q_elements += 2 * t.elements
            q_bytes += t.nbytes + block_scales.nbytes
            continue
        if not name.endswith(".weight"):
            continue
        stem = name[: -len(".weight")]
        scales = by_name.get(stem + ".scales")
        if scales is not None:
            q_elements += scales.elements * _group_size(stem, t, scales, quantization)
            biases = by_name.get(stem + ".biases")
            q_bytes += t.nbytes + scales.nbytes + (biases.nbytes if biases else 0)
        elif len(t.shape) == 2 and t.shape[-1] % DEFAULT_GROUP_SIZE == 0:
            q_elements += t.elements
            q_bytes += t.nbytes
    return WeightInventory(total, q_elements, q_bytes, quantization,
                           largest_fused_group_bytes(by_name.values()))


def _group_size(stem: str, weight: TensorInfo, scales: TensorInfo,
                quantization: Quantization | None) -> int:
    if scales.dtype.upper() in ("U8", "UINT8") and weight.shape and scales.shape:
        group = _MICROSCALING_GROUP.get(weight.shape[-1] // max(scales.shape[-1], 1))
        if group is not None:
            return group
    return quantization.for_layer(stem).group_size if quantization else DEFAULT_GROUP_SIZE


def largest_fused_group_bytes(tensors: Iterable[TensorInfo]) -> int:
    """Bytes of the largest complete projection group (``…q_proj.*`` + ``…k_proj.*`` +
    ``…v_proj.*`` under one parent, or gate/up): what fusing it at load adds for a moment."""
    by_group: dict[tuple[str, int], dict[str, int]] = {}
    for t in tensors:
        parent, _, rest = t.name.rpartition(".")[0].rpartition(".")
        for g, names in enumerate(FUSED_GROUPS):
            if rest in names:
                members = by_group.setdefault((parent, g), {})
                members[rest] = members.get(rest, 0) + t.nbytes
    return max((sum(m.values()) for (_, g), m in by_group.items() if len(m) == len(FUSED_GROUPS[g])),
               default=0)


# Hugging Face checkpoints that state a method, not bits (mlx-lm's load maps them the same).
_QUANT_METHODS = {"mxfp4": (4, 32), "mxfp8": (8, 32)}


def quantization_from_config(config: Mapping[str, Any]) -> Quantization | None:
    """mlx-lm writes ``"quantization": {"group_size": 64, "bits": 4, "mode": "affine"}``
    into config.json, plus an entry per module path quantized otherwise; gpt-oss as OpenAI
    ships it says ``"quantization_config": {"quant_method": "mxfp4"}``."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, Mapping):
        return None
    method = q.get("quant_method")
    if "bits" not in q and method in _QUANT_METHODS:
        bits, group = _QUANT_METHODS[method]
        return Quantization(bits, group, method)
    if "bits" not in q:
        return None
    default = _quantization(q)
    layers = tuple((path, _quantization(entry)) for path, entry in q.items()
                   if isinstance(entry, Mapping))
    return Quantization(default.bits, default.group_size, default.mode, layers)


def _quantization(entry: Mapping[str, Any]) -> Quantization:
    """A layer's entry holds `to_quantized`'s arguments: what it leaves out is their default."""
    return Quantization(int(entry.get("bits", 4)), int(entry.get("group_size", DEFAULT_GROUP_SIZE)),
                        str(entry.get("mode", "affine")))
