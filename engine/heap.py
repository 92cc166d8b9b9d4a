"""Giving freed host memory back to the OS, so the process's resident size falls.

On the Linux CPU backend MLX's buffers come from malloc; glibc keeps freed heap pages (and,
after large frees, raises its mmap threshold so later large blocks come from the heap
too). ``malloc_trim(0)`` returns the free pages; without it an unloaded model's weights
stay in the RSS that the Linux probe counts. A no-op where glibc is absent (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    return fn


def trim_heap() -> bool:
    """Return free heap pages to the OS; False where this libc cannot."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
