"""Reading a GGUF file: its metadata, and its tensors dequantized to float32.

The header is parsed here (``gguf.GGUFReader`` takes ~20 s on a 262k-token vocabulary, this
a fraction of a second); the tensor types' block sizes and the dequantization come from the
``gguf`` package. A file that is not GGUF, is cut short, or holds a tensor type we cannot
dequantize raises :class:`GGUFError` naming the file and what is wrong.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# What `gguf.quants.dequantize` turns back into floats (plain floats are cast).
SUPPORTED_TYPES = frozenset({
    "F32", "F16", "BF16", "F64",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
})

_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8",
          11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file that cannot be read or converted; the message names the file and why."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the file lists it; ``shape`` in numpy (row-major) order."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise EOFError("string runs past the end of the file")
        raw = bytes(self.buf[self.pos:end])
        self.pos = end
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.take("<I"), self.take("<Q")
            if item == _STRING:
                return [self.string() for _ in range(n)]
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                end = self.pos + n * dtype.itemsize
                if end > len(self.buf):
                    raise EOFError("array runs past the end of the file")
                arr = np.frombuffer(self.buf[self.pos:end], dtype=dtype).copy()
                self.pos = end
                return arr
            return [self.value(item) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {kind}")


class GGUFFile:
    """An opened GGUF file: ``architecture``, ``metadata`` and ``tensors`` (by name)."""

    def __init__(self, path: Path, *, header_only: bool = False) -> None:
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
        if bytes(self._data[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (no GGUF magic at its start)")
        try:
            self.metadata, self.tensors = self._parse(memoryview(self._data))
        except (EOFError, struct.error, ValueError, UnicodeDecodeError) as exc:
            raise GGUFError(f"{self.path}: the GGUF header cannot be read (truncated or "
                            f"corrupted?): {exc}") from exc
        for t in () if header_only else self.tensors.values():
            if t.offset + t.nbytes > self.size:
                raise GGUFError(f"{self.path} is truncated: tensor {t.name} ends at byte "
                                f"{t.offset + t.nbytes:,}, the file has {self.size:,}")
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no general.architecture in the GGUF metadata")
        self.architecture = arch

    def _parse(self, buf: memoryview) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        c = _Cursor(buf)
        c.pos = 4
        version = c.take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            metadata[key] = c.value(c.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take("<Q") for _ in range(c.take("<I"))]
            infos.append((name, dims, c.take("<I"), c.take("<Q")))
        align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = (c.pos + align - 1) // align * align
        tensors: dict[str, TensorEntry] = {}
        for name, dims, kind, offset in infos:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"tensor {name} has unknown type id {kind}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            elements = int(np.prod(dims, dtype=np.int64))
            tensors[name] = TensorEntry(name, qtype.name, tuple(int(d) for d in reversed(dims)),
                                        start + offset, elements // block * type_size)
        return metadata, tensors

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture field (``block_count`` is ``<arch>.block_count``) or a full key."""
        if key in self.metadata:
            return self.metadata[key]
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: the {self.architecture} metadata lacks {key!r}")
        return value

    def check_types(self) -> None:
        """Every tensor's type can be dequantized, or a GGUFError naming the ones that cannot."""
        bad = sorted({t.type_name for t in self.tensors.values()} - SUPPORTED_TYPES)
        if bad:
            raise GGUFError(f"{self.path}: tensor type(s) {', '.join(bad)} cannot be converted "
                            f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})")

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order (rows, columns)."""
        t = self.tensors[name]
        raw = self._data[t.offset:t.offset + t.nbytes]
        try:
            return _DECODERS.get(t.type_name, _dequantize(t.type_name))(raw).reshape(t.shape)
        except Exception as exc:
            raise GGUFError(f"{self.path}: tensor {name} ({t.type_name}, shape {t.shape}) "
                            f"cannot be read: {exc}") from exc


def _dequantize(type_name: str) -> Callable[[np.ndarray], np.ndarray]:
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    return lambda raw: quants.dequantize(np.asarray(raw), qtype).astype(np.float32, copy=False)


def _q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = np.asarray(raw).reshape(-1, 34)  # a float16 scale, then 32 int8 values
    scale = blocks[:, :2].copy().view("<f2").astype(np.float32)
    return (blocks[:, 2:].view(np.int8).astype(np.float32) * scale).reshape(-1)


def _bf16(raw: np.ndarray) -> np.ndarray:
    return (np.asarray(raw).view("<u2").astype(np.uint32) << 16).view(np.float32)


_DECODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "F32": lambda raw: np.asarray(raw).view("<f4").copy(),
    "F16": lambda raw: np.asarray(raw).view("<f2").astype(np.float32),
    "F64": lambda raw: np.asarray(raw).view("<f8").astype(np.float32),
    "BF16": _bf16,
    "Q8_0": _q8_0,
}


def open_gguf(path: str | Path, *, header_only: bool = False) -> GGUFFile:
    """The file opened; ``header_only``: its tensors' data may be missing (sizing only)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path} is not a file")
    return GGUFFile(path, header_only=header_only)
