"""Small index vectors built on the host, sized so that CUDA kernels read them from the GPU's
own memory.

Why. MLX's CUDA allocator serves every buffer of 8 bytes or less from a pool of host memory
that the GPU reads across the bus (`scalar_pool_` in mlx/backend/cuda/allocator.cpp: managed
memory advised `AccessedBy` the GPU, or pinned host memory where managed memory is limited).
At batch 1 a decode step's write slots, lengths and positions are one int32 each, and the
paged kernel's scale and partition size are one number each: every block of every kernel
that reads one waits on a host round trip. On the H200 (ncu, batch 1, 1,100 tokens) the
engine's paged kernel took 54.3 us per launch reading 4-byte buffers and 7.5 us reading
these (docs/throughput.md).

A vector here is padded on the host to `MIN_BYTES` and sliced back to its length: the slice
is a view, so the kernels see the values they always saw, in a buffer the allocator gives
the GPU like any other (`cudaMallocManaged`, migrated on first use). On the CPU and Metal,
where memory is one, the padding costs a few bytes and changes nothing.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

MIN_BYTES = 16  # above the allocator's 8-byte scalar blocks


def device_vector(values: np.ndarray | list[int] | list[float], dtype: mx.Dtype = mx.int32) -> mx.array:
    """`values` ([n]) as an MLX array whose buffer holds at least MIN_BYTES."""
    host = np.asarray(values, dtype=_NUMPY[dtype])
    n = host.shape[0]
    floor = -(-MIN_BYTES // host.itemsize)
    if n >= floor:
        return mx.array(host)
    padded = np.zeros(floor, dtype=host.dtype)
    padded[:n] = host
    return mx.array(padded)[:n]


_NUMPY = {mx.int32: np.int32, mx.uint32: np.uint32, mx.float32: np.float32}
