"""Probes: read the machine's memory into a :class:`~memory.snapshot.MemorySnapshot`."""

from .allocator import AllocatorProbe
from .base import Probe
from .cuda import CudaProbe
from .detect import detect_probe
from .linux import LinuxProbe
from .macos import MacOSProbe
from .nvml import NvmlReading, PynvmlReader, process_footprint
from .resilient import ResilientProbe

__all__ = [
    "AllocatorProbe",
    "CudaProbe",
    "LinuxProbe",
    "MacOSProbe",
    "NvmlReading",
    "Probe",
    "PynvmlReader",
    "ResilientProbe",
    "detect_probe",
    "process_footprint",
]
