"""Mark a stretch of work for a CUDA profiler started with `--profile-from-start off`.

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes.sum --csv \\
        python3 -m bench.engine_step --model llama3-8b --dtype bfloat16 --split-only --batch 1 \\
        --steps 2 --profile

Nsight Compute then measures only the kernels of the timed decode steps: each kernel's
device time and DRAM bytes, which is what puts a step against the memory bandwidth's bound.
Without CUDA (or without the runtime library) this does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager


def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library: always shared (MLX may link the runtime statically), and
    its `cuProfilerStart` acts on the context MLX made current on this thread."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@contextmanager
def profiled(enabled: bool = True) -> Iterator[None]:
    driver = _driver() if enabled else None
    if driver is not None:
        driver.cuProfilerStart()
    try:
        yield
    finally:
        if driver is not None:
            driver.cuProfilerStop()
