"""The probe protocol, and the one place probes touch MLX's allocator counters."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..snapshot import MemorySnapshot


@runtime_checkable
class Probe(Protocol):
    """Anything that can take a :class:`MemorySnapshot`. ``read()`` must be cheap
    (well under a millisecond): the engine calls it before every prefill chunk."""

    def read(self) -> MemorySnapshot: ...


def mlx_allocator_bytes() -> tuple[int, int]:
    """Return MLX's ``(active, cache)`` byte counts.

    ``mlx.core`` is imported here, lazily, so that importing :mod:`memory` never loads
    MLX (policy code and its tests stay free of it).
    """
    import mlx.core as mx

    return int(mx.get_active_memory()), int(mx.get_cache_memory())
