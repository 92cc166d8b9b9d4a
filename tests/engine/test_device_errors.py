"""Every out-of-memory message MLX raises is recognised; nothing else is."""

from __future__ import annotations

import pytest

from engine.device_errors import is_out_of_memory

OUT_OF_MEMORY = [
    "[cudaMallocAsync] cudaMallocAsync(&data, size, stream) failed: out of memory",
    "[METAL] Command buffer execution failed: Insufficient Memory "
    "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
    "[malloc] Unable to allocate 34359738368 bytes.",
    "[metal::malloc] Attempting to allocate 90000000000 bytes which is greater than the maximum "
    "allowed buffer size of 77309411328 bytes.",
    "[metal::malloc] Resource limit (499000) exceeded.",
]

NOT_MEMORY = [
    "[broadcast_shapes] Shapes (25,1,8) and (25,4,16) cannot be broadcast.",
    "[METAL] Command buffer execution failed: Caused GPU Timeout Error",
    "an engine bug",
]


@pytest.mark.parametrize("message", OUT_OF_MEMORY)
def test_each_out_of_memory_message_is_recognised(message):
    assert is_out_of_memory(RuntimeError(message))


@pytest.mark.parametrize("message", NOT_MEMORY)
def test_other_errors_are_not_memory_errors(message):
    assert not is_out_of_memory(ValueError(message))
