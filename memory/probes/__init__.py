"""Probes: read the machine's memory into a :class:`~memory.snapshot.MemorySnapshot`."""

from .allocator import AllocatorProbe
from .base import Probe
from .cuda import CudaProbe
from .detect import detect_probe
from .linux import LinuxProbe
from .macos import MacOSProbe
from .resilient import ResilientProbe

__all__ = [
    "AllocatorProbe",
    "CudaProbe",
    "LinuxProbe",
    "MacOSProbe",
    "Probe",
    "ResilientProbe",
    "detect_probe",
]
