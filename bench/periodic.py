"""A task that samples a server every `interval_s` seconds while a benchmark runs.

Subclasses say what one sample is (`tick`); this runs it on a schedule from `start` (or
`async with`) to `stop`, one HTTP client for the whole run, each sleep shortened by the
time the sample itself took.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx


class Periodic:
    interval_s: float = 1.0
    min_sleep_s: float = 0.0  # the least pause between samples
    _task: asyncio.Task[None] | None = None

    async def tick(self, client: httpx.AsyncClient) -> None:
        raise NotImplementedError

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient()

    async def _loop(self) -> None:
        async with self.client() as client:
            while True:
                started = time.monotonic()
                await self.tick(client)
                await asyncio.sleep(max(self.min_sleep_s, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def __aenter__(self) -> Periodic:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
