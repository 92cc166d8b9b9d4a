"""How busy the GPU was over a stretch of work, as the driver counts it (NVML).

At C=1 on the H200 the engine's decode step is 6.4 ms against a bare mlx-lm step of
4.5 ms, and 4.6 ms of it is spent inside `mx.async_eval` (docs/throughput.md, session 7).
That time is either MLX encoding and launching the step (the host sets the pace, the GPU
idles between kernels) or MLX blocking until earlier work finishes (it waits once more
than 10 command buffers are in flight, `mlx/transforms.cpp`, so the GPU sets the pace).
The driver's utilisation, the share of time in which some kernel was running, tells the
two apart: near 100 % the device is the bottleneck, well below it the host is.

    with GpuBusy() as busy:
        ...  # a few seconds of steps
    busy.percent  # None without NVML (the CPU, Metal, or no nvidia-ml-py)
"""

from __future__ import annotations

import statistics
import threading
import time
from types import TracebackType
from typing import Any

from memory.probes.nvml import visible_device


class GpuBusy:
    """Polls NVML's utilisation on a thread while the block runs.

    NVML averages over its own sample period (a sixth of a second to a second, by device),
    so the first reading, which covers time before the block, is dropped, and the block
    should run for a few seconds."""

    def __init__(self, period_s: float = 0.05, skip_s: float = 0.3) -> None:
        self.period_s = period_s
        self.skip_s = skip_s
        self.samples: list[int] = []
        self.percent: float | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml  # type: ignore[import-not-found, unused-ignore]

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, visible_device(pynvml)
        except Exception:  # no package, no driver, no device: report None
            self._nvml = None

    def __enter__(self) -> GpuBusy:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.samples:
            self.percent = round(statistics.mean(self.samples), 1)

    def _poll(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(self.period_s):
            if time.perf_counter() - start >= self.skip_s:
                self.samples.append(int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
