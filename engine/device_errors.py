"""What MLX says when the device runs out of memory, on every backend, in one place.

Admission predicts memory before each prefill chunk so that these never happen; where MLX
raises a catchable error anyway, the engine refuses the requests involved with 507 and
keeps serving (`EngineCore._recover_from_device_oom`). Everything else raised inside a
step is a step failure (500 for that step's requests), not a memory refusal.

The messages, as MLX 0.32 raises them:

- CUDA: ``[cudaMallocAsync] cudaMallocAsync(&data, size, stream) failed: out of memory``
- Metal, a command buffer the GPU could not back: ``[METAL] Command buffer execution
  failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)``
- Metal and the CPU, an allocation refused up front: ``[malloc] Unable to allocate N bytes.``
- Metal, a buffer above the device's largest: ``[metal::malloc] Attempting to allocate N
  bytes which is greater than the maximum allowed buffer size of M bytes.``
- Metal, the allocator's buffer count at the device's resource limit (cached buffers count,
  so clearing MLX's cache frees them): ``[metal::malloc] Resource limit (N) exceeded.``
"""

from __future__ import annotations

import re

OUT_OF_MEMORY_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"out of memory",
        r"insufficient memory",
        r"kIOGPUCommandBufferCallbackErrorOutOfMemory",
        r"\[malloc\] unable to allocate",
        r"\[metal::malloc\] attempting to allocate .* greater than the maximum allowed buffer size",
        r"\[metal::malloc\] resource limit \(\d+\) exceeded",
    )
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether MLX raised `exc` because the device could not allocate."""
    text = str(exc)
    return any(p.search(text) for p in OUT_OF_MEMORY_PATTERNS)
