"""Pick the probe for this machine."""

from __future__ import annotations

import sys

from .allocator import AllocatorProbe
from .base import Probe
from .cuda import CudaProbe
from .linux import LinuxProbe
from .macos import MacOSProbe

KINDS = ("auto", "macos", "linux", "cuda", "allocator")


def _cuda_available() -> bool:
    import mlx.core as mx

    try:
        return bool(mx.cuda.is_available())
    except AttributeError:  # builds without the cuda submodule
        return False


def detect_probe(kind: str = "auto") -> Probe:
    """Return a probe by name; ``"auto"`` picks CUDA if MLX has it, macOS on Darwin,
    else Linux. Raises ``ValueError`` for an unknown kind."""
    if kind not in KINDS:
        raise ValueError(f"unknown probe kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind == "auto":
        if _cuda_available():
            kind = "cuda"
        elif sys.platform == "darwin":
            kind = "macos"
        else:
            kind = "linux"
    if kind == "cuda":
        return CudaProbe()
    if kind == "macos":
        return MacOSProbe()
    if kind == "linux":
        return LinuxProbe()
    return AllocatorProbe()
