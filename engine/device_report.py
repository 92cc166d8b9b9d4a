"""Which device MLX got, and whether Metal is usable: logged at start, printed by doctor.

A LaunchDaemon starts at boot, before anyone logs in; whether Metal serves a process then
is not something we have verified, so the server says what it got instead of assuming:
`mx.metal.is_available()` and, where it says yes, one small computation on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceReport:
    backend: str  # "metal" | "cuda" | "cpu"
    default_device: str
    metal_available: bool  # mx.metal.is_available()
    metal_usable: bool  # a computation on the GPU stream returned the right answer
    problem: str | None = None

    def describe(self) -> str:
        if self.metal_usable:
            metal = "Metal usable"
        elif self.metal_available:
            metal = f"Metal available but not usable ({self.problem})"
        else:
            metal = "Metal not available"
        return f"device {self.default_device}, backend {self.backend}, {metal}"


def device_report(mx: Any = None) -> DeviceReport:
    """Ask MLX (`mx` is injectable: tests pass a fake module)."""
    if mx is None:
        import mlx.core as mx
    metal_available = bool(mx.metal.is_available())
    if metal_available:
        backend = "metal"
    elif mx.cuda.is_available():
        backend = "cuda"
    else:
        backend = "cpu"
    usable, problem = False, None
    if metal_available:
        try:
            x = mx.add(mx.ones((4,), stream=mx.gpu), 1, stream=mx.gpu)
            mx.eval(x)
            usable = float(mx.sum(x).item()) == 8.0
            if not usable:
                problem = "a test computation on the GPU returned a wrong answer"
        except Exception as exc:  # what Metal says is the finding
            problem = f"{type(exc).__name__}: {exc}"
    return DeviceReport(backend, str(mx.default_device()), metal_available, usable, problem)
