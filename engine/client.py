"""The asyncio side of the engine: submit, stream, abort; it never blocks on MLX.

Requests go to the engine thread through its inbox. Outputs come back once per engine
step, in one `loop.call_soon_threadsafe` call that fans them out to per-request queues.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import mlx.core as mx

from engine.core import EngineConfig, EngineCore, EngineStats
from engine.device_report import device_report
from engine.errors import EngineDeadError, QueueFullError
from engine.loader import LoadedModel, on_cuda_by_default
from engine.request import EngineRequest, RequestOutput
from engine.warmup import warm_up
from engine.wired import WIRED, WiredWeights
from memory import MemoryGuard

log = logging.getLogger("mlx_headroom.engine")

ENGINE_JOIN_TIMEOUT_S = 30.0  # a decode step of a big batch plus the teardown


class RequestStream:
    """Outputs of one request, in order; closing it early aborts the request."""

    def __init__(self, client: EngineClient, request_id: str) -> None:
        self.request_id = request_id
        self._client = client
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next(self) -> RequestOutput:
        """The next output; raises the request's error (a 507 refusal, a dead engine)."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
            if item.error is not None:
                raise item.error
        return item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.next()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._client.abort(self.request_id)


class EngineClient:
    def __init__(
        self,
        *,
        load: Callable[[], LoadedModel],
        guard: MemoryGuard,
        config: EngineConfig,
        max_queue: int,
        on_death: Callable[[BaseException], None] | None = None,
        make_core: Callable[[LoadedModel, MemoryGuard, EngineConfig, Callable[[list[RequestOutput]], None]],
                            EngineCore] = EngineCore,
        wired: WiredWeights = WIRED,
    ) -> None:
        self._load = load
        self._wired = wired
        self._make_core = make_core
        self._on_death = on_death
        self.guard = guard
        self.config = config
        self.max_queue = max_queue
        self.core: EngineCore | None = None
        self.loaded: LoadedModel | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._dead: BaseException | None = None
        self.stopped_cleanly = False  # set by shutdown(): the engine thread ended after stop()

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        # The engine thread hands the GIL back and forth with the event loop every step;
        # at CPython's default 5 ms switch interval each handoff can stall the decode loop
        # for that long while the loop is busy streaming. 1 ms (the default) took C=8 from
        # 225 to 536 tok/s on the H200; 0.5 and 0.1 ms were not clearly better
        # (docs/throughput.md). The value is process-wide.
        sys.setswitchinterval(self.config.gil_switch_interval_s)
        interval_ms = round(sys.getswitchinterval() * 1000, 3)  # read back: what the process runs with
        log.info("GIL switch interval: %s ms", interval_ms, extra={"gil_switch_interval_ms": interval_ms})
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = self._loop.create_future()

        def on_ready(exc: BaseException | None) -> None:
            if not ready.done():
                ready.set_exception(exc) if exc else ready.set_result(None)

        def main() -> None:
            assert self._loop is not None
            try:
                report = device_report()
                log.info("MLX: %s", report.describe(), extra={"device": report.__dict__})
                self.loaded = self._load()
                self._wire(self.loaded)
                self.core = self._make_core(self.loaded, self.guard, self.config, self._publish)
                warm = on_cuda_by_default(self.config.warm_up, self.loaded.backend)
                if warm and self.core.lockstep is None:
                    warm_up(self.core)
            except BaseException as exc:
                log.exception("the engine failed to start")
                self._dead = exc
                self._loop.call_soon_threadsafe(on_ready, exc)
                return
            self._loop.call_soon_threadsafe(on_ready, None)
            try:
                self.core.run_forever()
            except BaseException as exc:
                log.exception("the engine thread died")
                self._dead = exc
                self._loop.call_soon_threadsafe(self._fail_all, exc)
                if self._on_death is not None:
                    self._loop.call_soon_threadsafe(self._on_death, exc)
            finally:
                self._release_mlx()

        self._thread = threading.Thread(target=main, name="mlx-headroom-engine", daemon=True)
        self._thread.start()
        await ready

    def _wire(self, loaded: LoadedModel) -> None:
        """Keep the weights resident (Metal) when the guard has room for them (engine.wired)."""
        try:
            ceiling = self._wire_ceiling()
        except Exception as exc:  # no reading, no promise of room: wire nothing
            log.warning("not wiring %s's weights: the memory probe failed (%s)", loaded.model_id, exc)
            return
        self._wired.hold(self._wired_key, loaded.weight_bytes, ceiling=ceiling)

    def _unwire(self) -> None:
        """Stop wiring this model's weights. The other models' are wired again under the
        room check their load passed (`_wire`), against the ceiling now: it may have fallen."""
        try:
            ceiling: int | None = self._wire_ceiling()
        except Exception as exc:  # no reading, no promise of room: as at load, wire nothing
            log.warning("wiring no model's weights: the memory probe failed (%s)", exc)
            ceiling = 0
        self._wired.release(self._wired_key, ceiling=ceiling)

    def _wire_ceiling(self) -> int | None:
        """The room wired weights must fit in: the guard's hard ceiling, None while it is
        off. Raises when the probe cannot read."""
        return self.guard.ceiling().hard_bytes if self.guard.state().enabled else None

    @property
    def _wired_key(self) -> str:
        return f"{id(self):x}"

    def _release_mlx(self) -> None:
        """On the engine thread, after its loop: free the model, the caches and the batch
        here, collect what referenced them, wait for the device, then drop this thread's
        MLX streams and random state (`mx.clear_streams`).

        The last step is what keeps exit clean: MLX keeps each thread's random key in a
        C++ thread-local whose destructor takes the GIL. Python's `join()` returns before
        a thread's thread-locals are destroyed, so that destructor could run while the
        main thread was already finalizing the interpreter; taking the GIL then ends the
        thread with pthread_exit inside a noexcept destructor, and the process aborted
        with "terminate called without an active exception" (exit 134). Seen on CUDA and,
        1 run in 3, on the CPU."""
        try:
            if self.core is not None:
                self.core.release()
            self.loaded = None
            gc.collect()
            mx.synchronize()
            self._unwire()  # after the device is idle, as MLX asks
            mx.clear_cache()
            mx.clear_streams()
        except BaseException:
            log.exception("releasing MLX state on the engine thread failed")

    @property
    def alive(self) -> bool:
        return (
            self.core is not None
            and self._dead is None
            and self._thread is not None
            and self._thread.is_alive()
        )

    @property
    def death_reason(self) -> str | None:
        """Why the engine stopped serving (it failed to start, its thread died, or `fail`
        ended it): the exception's type and message, the engine's own words and no request's
        text, so that /health can say why it is down. None while it runs or after a clean stop."""
        if self._dead is None:
            return None
        return f"{type(self._dead).__name__}: {self._dead}"

    @property
    def stats(self) -> EngineStats:
        return self.core.stats if self.core else EngineStats()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def shutdown(self, grace_s: float) -> None:
        """Stop taking work; let what is in flight finish for `grace_s`, then cancel it."""
        if self.core is None:
            return
        deadline = asyncio.get_running_loop().time() + grace_s
        while self._streams and asyncio.get_running_loop().time() < deadline and self.alive:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self.core.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, ENGINE_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                log.error("the engine thread did not end within %.0fs of being stopped",
                          ENGINE_JOIN_TIMEOUT_S)
                return
        self.stopped_cleanly = self._dead is None
        log.info("engine thread ended; MLX state released")

    # ---- requests --------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> RequestStream:
        if not self.alive or self.core is None:
            raise EngineDeadError("the engine is not running")
        if len(self._streams) >= self.config.max_concurrency + self.max_queue:
            raise QueueFullError(
                max(len(self._streams) - self.config.max_concurrency, 0), self.max_queue
            )
        if request.request_id in self._streams:
            raise ValueError(f"duplicate request id {request.request_id}")
        stream = RequestStream(self, request.request_id)
        self._streams[request.request_id] = stream
        self.core.submit(request)
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
        if self.core is not None:
            self.core.abort(request_id)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between two steps and return its result."""
        if not self.alive or self.core is None:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def done(result: Any, exc: BaseException | None) -> None:
            def settle() -> None:
                if future.done():
                    return
                future.set_exception(exc) if exc else future.set_result(result)

            loop.call_soon_threadsafe(settle)

        self.core.call(fn, done)
        return await future

    async def follow_memory_policy(self) -> int | None:
        """Have the engine re-derive MLX's cache limit from the guard's new policy; None
        when the engine is not running."""
        if not self.alive or self.core is None:
            return None
        core = self.core
        limit: int = await self.call(core.follow_memory_policy)
        return limit

    # ---- engine thread → loop --------------------------------------------------------
    def _publish(self, outputs: list[RequestOutput]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream._put(output)
            if output.finish_reason is not None:
                del self._streams[output.request_id]

    def fail(self, exc: BaseException) -> None:
        """From any thread, when the engine can no longer run though its thread may be stuck
        (a tensor-parallel peer is gone): fail what is in flight, refuse what comes next."""
        self._dead = exc
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _fail_all(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"the engine thread died: {exc}")
        for stream in self._streams.values():
            stream._put(error)
        self._streams.clear()
