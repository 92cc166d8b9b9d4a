"""Several models under one memory budget: which may load, loading on demand, unloading.

One engine per loaded model (docs/multi-model.md says why): each has its own engine
thread, where its model is loaded, run and freed, and each asks the one guard through a
:class:`memory.shared.GuardView`, so every engine's admission counts what the others were
promised. The pool only decides *which* models are resident; every byte of a load is
judged by part 1's computation (:func:`server.model_fit.fit_for_settings`) on a fresh
reading of the whole process, which already holds the other models' weights and KV.

A request holds a *lease* on its model from the moment the model is resolved until its
response has been sent (:class:`ModelLeaseMiddleware`), so a model is never unloaded
between being chosen and being submitted to, nor while it streams.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from engine import EngineClient, load_model
from engine.heap import trim_heap
from memory import MemoryGuard
from memory.decision import usage_bytes
from memory.fit import FitReport
from memory.shared import GuardView, SharedCommitments
from server.engine_config import engine_config
from server.errors import APIError, BadRequest, Conflict, InsufficientStorage, NotFound
from server.model_fit import LoadAdmission, fit_for_settings, fit_json, read_spec
from server.settings import Settings
from server.state import ServerState, get_state
from server.stats import EngineTotals

log = logging.getLogger("mlx_headroom.server")

TTL_POLL_MAX_S = 1.0

_leases: contextvars.ContextVar[list[ModelEntry] | None] = contextvars.ContextVar(
    "model_leases", default=None
)


def wants_pool(settings: Settings) -> bool:
    """Several models (or on-demand loading, pinning, TTL) were asked for."""
    return bool(settings.extra_models or settings.allowed_models or settings.idle_unload_s)


@dataclass
class Unload:
    """One unload, measured: the process's usage as the guard's probe reads it before the
    engine let go and after its thread freed the model and emptied MLX's cache."""

    model: str
    reason: str  # "lru" (made room for another model) or "idle" (--idle-unload-s)
    before_bytes: int
    after_bytes: int
    weight_bytes: int
    at: float = field(default_factory=time.time)

    @property
    def freed_bytes(self) -> int:
        return self.before_bytes - self.after_bytes


@dataclass
class ModelEntry:
    """A model this server may serve, loaded or not."""

    id: str
    path: str
    pinned: bool = False
    state: str = "unloaded"  # unloaded | loading | loaded | unloading
    engine: EngineClient | None = None
    view: ServerState | None = None
    admission: LoadAdmission | None = None
    last_used: float = 0.0
    leases: int = 0
    load_bytes: int = 0  # the usage the load added, measured
    weight_bytes: int = 0
    loads: int = 0

    @property
    def busy(self) -> bool:
        return self.leases > 0 or (self.engine is not None and self.engine.in_flight > 0)

    def freeable_bytes(self) -> int:
        """What unloading it should give back: its measured load, its KV pool."""
        if self.engine is None:
            return 0
        return max(self.load_bytes, self.weight_bytes) + self.engine.stats.kv_pool_bytes


class ModelDoesNotFit(InsufficientStorage):
    """507: the model cannot be loaded even after unloading every idle, unpinned model."""


def _list_allowed(items: list[str]) -> dict[str, str]:
    """`--allowed-models` items: a model (directory or hub id), or a directory of model
    directories (each subdirectory with a config.json, named by its directory name)."""
    out: dict[str, str] = {}
    for item in items:
        path = Path(item)
        if path.is_dir() and not (path / "config.json").exists():
            for sub in sorted(path.iterdir()):
                if (sub / "config.json").is_file():
                    out.setdefault(sub.name, str(sub))
        else:
            out.setdefault(item, item)
    return out


class ModelPool:
    """The models of one server: the primary (`--model`, first), the others given with
    `--model`, and those `--allowed-models` lets load on demand."""

    def __init__(self, settings: Settings, guard: MemoryGuard, *,
                 on_death: Any = None) -> None:
        self.settings = settings
        self.guard = guard
        self.shared = SharedCommitments()
        self.on_death = on_death
        self.entries: dict[str, ModelEntry] = {}
        self.unloads: list[Unload] = []
        self.refusals = 0
        # token counters of engines since unloaded: the pool's totals stay monotonic
        self.retired_prompt_tokens = 0
        self.retired_generated_tokens = 0
        self._lock = asyncio.Lock()
        self._ttl_task: asyncio.Task[None] | None = None
        self.base: ServerState | None = None
        primary = ModelEntry(settings.public_model_name, settings.model)
        self.entries[primary.id] = primary
        for item in settings.extra_models:
            self.entries.setdefault(item, ModelEntry(item, item))
        known = {os.path.realpath(e.path) for e in self.entries.values()}
        for name, path in _list_allowed(settings.allowed_models).items():
            if os.path.realpath(path) not in known:  # a --model is listed once, by its name
                self.entries.setdefault(name, ModelEntry(name, path))
        for name in settings.pin:
            entry = self.find(name)
            if entry is None:
                raise ValueError(f"--pin {name!r}: not a model this server may load")
            entry.pinned = True
        self.primary = primary

    # ---- engines ---------------------------------------------------------------------
    def guard_for(self, entry: ModelEntry) -> MemoryGuard:
        view: Any = GuardView(self.guard, self.shared, entry.id)
        return view  # duck-typed: the engine calls check/record/snapshot/state/ceiling

    def new_engine(self, entry: ModelEntry) -> EngineClient:
        s = self.settings
        return EngineClient(
            load=lambda: load_model(entry.path, model_id=entry.id, load_format=s.load_format,
                                    dtype=s.dtype, fuse_projections=s.fuse_projections,
                                    small_m_kernel=s.small_m_kernel,
                                    context_length=s.context_length if entry is self.primary else None),
            guard=self.guard_for(entry), config=engine_config(s), max_queue=s.max_queue,
            on_death=self.on_death,
        )

    def attach_primary(self, state: ServerState) -> None:
        """The app built the primary's engine and state; the pool keeps them."""
        self.base = state
        entry = self.primary
        entry.engine, entry.view, entry.admission = state.engine, state, state.load_admission

    def _view(self, entry: ModelEntry, engine: EngineClient) -> ServerState:
        assert self.base is not None
        if entry is self.primary:  # the server-wide state is the primary's own
            self._rebase(engine)
            return self.base
        settings = self.settings.model_copy(
            update={"model": entry.path, "served_model_name": entry.id, "model_aliases": {},
                    "context_length": None}
        )
        return dataclasses.replace(self.base, settings=settings, engine=engine,
                                   load_admission=entry.admission, grammar_compiler=None)

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """After the primary engine started: note it, load the other `--model`s (admitted,
        nothing unloaded for them), start the idle timer."""
        entry = self.primary
        assert entry.engine is not None
        entry.state, entry.last_used, entry.loads = "loaded", time.monotonic(), 1
        entry.weight_bytes = entry.engine.loaded.weight_bytes if entry.engine.loaded else 0
        entry.load_bytes = entry.weight_bytes
        try:
            for item in self.settings.extra_models:
                async with self._lock:
                    await self._load(self.entries[item], make_room=False)
        except BaseException as exc:
            # Start-up fails: stop every engine thread first (the primary's included), so
            # none outlives the interpreter (see EngineClient._release_mlx).
            log.error("not starting: %s", exc)
            await self.shutdown(0.0)
            raise
        if self.settings.idle_unload_s:
            self._ttl_task = asyncio.create_task(self._ttl_loop(self.settings.idle_unload_s))

    async def shutdown(self, grace_s: float) -> None:
        if self._ttl_task is not None:
            self._ttl_task.cancel()
        for entry in self.entries.values():
            if entry.engine is not None:
                await entry.engine.shutdown(grace_s)

    # ---- requests --------------------------------------------------------------------
    def find(self, name: str) -> ModelEntry | None:
        if name in self.entries:
            return self.entries[name]
        if self.base is not None and self.base.serves(name):
            return self.primary
        for entry in self.entries.values():
            if name in (entry.path, Path(entry.path).name):
                return entry
        return None

    async def resolve(self, name: str) -> ServerState:
        """The state to serve `name` with, its model loaded (404 outside the allowed list,
        507 when it cannot be made to fit, 500 `model_load_failed` with the cause when its
        files do not load); the request holds a lease on it."""
        entry = self.find(name)
        if entry is None:
            raise NotFound(f"The model '{name}' does not exist; this server serves "
                           f"{sorted(self.entries)}", code="model_not_found", param="model")
        if entry.state != "loaded" or entry.engine is None or not entry.engine.alive:
            async with self._lock:
                if entry.state != "loaded":
                    try:
                        await self._load(entry, make_room=True)
                    except APIError:
                        raise
                    except Exception as exc:  # the engine logged the traceback
                        raise APIError(f"The model '{entry.id}' could not be loaded: {exc}",
                                       code="model_load_failed", param="model") from exc
        self._lease(entry)
        assert entry.view is not None
        return entry.view

    def _lease(self, entry: ModelEntry) -> None:
        entry.leases += 1
        entry.last_used = time.monotonic()
        held = _leases.get()
        if held is not None:
            held.append(entry)
        else:  # outside the middleware (never on a route): nothing would release it
            entry.leases -= 1

    @staticmethod
    def release(entries: list[ModelEntry]) -> None:
        now = time.monotonic()
        for entry in entries:
            entry.leases -= 1
            entry.last_used = now

    # ---- loading and unloading ---------------------------------------------------------
    def _policy_settings(self) -> Settings:
        """The settings with the guard's policy now (PUT /v1/memory-guard may have moved it)."""
        st = self.guard.state()
        return self.settings.model_copy(update={
            "memory_guard": st.enabled, "memory_tier": st.tier.value,
            "memory_ceiling_bytes": st.ceiling_bytes,
        })

    async def _usage(self) -> int:
        return usage_bytes(await asyncio.to_thread(self.guard.snapshot))

    async def _hand_back(self) -> None:
        """Have a loaded engine hand back MLX's cached buffers (one allocator serves every
        engine) so the reading counts what is held, not what is cached."""
        for e in self.entries.values():
            engine = e.engine
            if e.state == "loaded" and engine is not None and engine.alive:
                core = engine.core
                assert core is not None
                await engine.call(core.admission.hand_back)
                return

    async def _fit(self, entry: ModelEntry) -> FitReport:
        settings = self._policy_settings()
        if entry is not self.primary:  # --context-length is the primary's alone
            settings = settings.model_copy(update={"context_length": None})
        await self._hand_back()
        spec = await asyncio.to_thread(read_spec, settings,
                                       None if entry is self.primary else entry.path)
        snapshot = await asyncio.to_thread(self.guard.snapshot)
        # What the engines were admitted for and have not allocated yet counts as in use.
        pending = sum(self.shared.snapshot().values())
        if pending:
            snapshot = dataclasses.replace(
                snapshot, footprint_bytes=snapshot.footprint_bytes + pending)
        return fit_for_settings(settings, spec, snapshot)

    def _victims(self, exclude: ModelEntry) -> list[ModelEntry]:
        """Loaded models that may go, least recently used first."""
        idle = [e for e in self.entries.values()
                if e is not exclude and e.state == "loaded" and not e.pinned and not e.busy]
        return sorted(idle, key=lambda e: e.last_used)

    async def _load(self, entry: ModelEntry, *, make_room: bool) -> None:
        """Admit (unloading LRU idle models while it does not fit), then load. Call with
        the lock held."""
        report: FitReport | None = None
        if self.guard.state().enabled:
            report = await self._fit(entry)
            while not report.fits:
                victims = self._victims(entry) if make_room else []
                freeable = sum(v.freeable_bytes() for v in victims)
                if not make_room and self.settings.force_load:  # at start, as for the first
                    log.warning("--force-load: loading %s although the reserve is not met: %s",
                                entry.id, report.message())
                    break
                if report.shortfall_bytes > freeable:
                    self.refusals += 1
                    raise self._refusal(entry, report, victims, freeable)
                await self._unload(victims[0], reason="lru")
                report = await self._fit(entry)
            log.info("load admission for %s: %s", entry.id, report.message())
        entry.admission = (LoadAdmission(report, forced=not report.fits)
                           if report is not None else None)
        entry.state = "loading"
        engine = self.new_engine(entry)
        before = await self._usage()
        loading = f"load:{entry.id}"
        if report is not None:  # the engines count the load's bytes until they are in use
            self.shared.set(loading, report.load.total_bytes - report.load.baseline_bytes)
        try:
            await engine.start()
        except BaseException:
            entry.state = "unloaded"
            raise
        finally:
            self.shared.drop(loading)
        entry.engine = engine
        entry.view = self._view(entry, engine)
        entry.weight_bytes = engine.loaded.weight_bytes if engine.loaded else 0
        entry.load_bytes = max(await self._usage() - before, 0)
        entry.state, entry.last_used = "loaded", time.monotonic()
        entry.loads += 1
        if self.base is not None and not self.base.ready:
            self._rebase(engine)  # nothing else is loaded: health and stats follow this one
        log.info("loaded %s: %d bytes of weights, usage +%d bytes", entry.id,
                 entry.weight_bytes, entry.load_bytes)

    def _refusal(self, entry: ModelEntry, report: FitReport, victims: list[ModelEntry],
                 freeable: int) -> ModelDoesNotFit:
        held = [e.id for e in self.entries.values()
                if e.state == "loaded" and e is not entry and e not in victims]
        message = (
            f"The model '{entry.id}' does not fit: {report.message()} Unloading every idle, "
            f"unpinned model would free about {freeable} bytes of the {report.shortfall_bytes} "
            f"needed; kept loaded (pinned or serving requests): {held or 'none'}."
        )
        log.info("refused to load %s: %d bytes short", entry.id, report.shortfall_bytes)
        return ModelDoesNotFit(message, code="model_does_not_fit", param="model", extra={
            "model": entry.id,
            "needed_bytes": report.load.total_bytes,
            "limit_bytes": report.ceiling.hard_bytes,
            "binding": report.ceiling.binding,
            "shortfall_bytes": report.shortfall_bytes,
            "freeable_bytes": freeable,
            "kept_loaded": held,
        }, headers={"x-should-retry": "false"})

    async def unload_on_request(self, name: str) -> ModelEntry:
        """DELETE /v1/models/{id}: unload a model loaded on demand (`--allowed-models`).
        404 for a model this server may not serve, 400 for one it keeps loaded (the
        `--model`s, pinned ones), 409 while requests use it; unloading an unloaded model
        is done already."""
        entry = self.find(name)
        if entry is None:
            raise NotFound(f"The model '{name}' does not exist; this server serves "
                           f"{sorted(self.entries)}", code="model_not_found", param="model")
        if entry is self.primary or entry.id in self.settings.extra_models or entry.pinned:
            raise BadRequest(f"The model '{entry.id}' is kept loaded by this server's "
                             "configuration (--model, --pin); only models loaded on demand "
                             "can be unloaded", code="model_not_unloadable", param="model")
        async with self._lock:
            if entry.state == "loaded":
                if entry.busy:
                    raise Conflict(f"The model '{entry.id}' is serving requests; unload it "
                                   "when they have finished", code="model_in_use", param="model")
                await self._unload(entry, reason="request")
        return entry

    async def _unload(self, entry: ModelEntry, *, reason: str) -> None:
        """Stop the model's engine; its thread frees the model, collects, synchronizes and
        empties MLX's cache before it ends (EngineClient._release_mlx)."""
        engine = entry.engine
        assert engine is not None
        entry.state = "unloading"
        before = await self._usage()
        await engine.shutdown(0.0)
        await asyncio.to_thread(trim_heap)  # the CPU's freed heap back to the OS (engine/heap.py)
        self.shared.drop(entry.id)
        after = await self._usage()
        # with no await in between, so `totals()` never counts this engine twice or not at all
        self.retired_prompt_tokens += engine.stats.prompt_tokens
        self.retired_generated_tokens += engine.stats.generated_tokens
        entry.engine, entry.view, entry.state = None, None, "unloaded"
        record = Unload(entry.id, reason, before, after, entry.weight_bytes)
        self.unloads.append(record)
        del self.unloads[:-32]
        log.info("unloaded %s (%s): usage %d -> %d bytes (%d freed; weights %d)", entry.id,
                 reason, before, after, record.freed_bytes, entry.weight_bytes)
        if self.base is not None and self.base.engine is engine:
            other = next((e.engine for e in self.entries.values()
                          if e.state == "loaded" and e.engine is not None), None)
            if other is not None:
                self._rebase(other)

    def _rebase(self, engine: EngineClient) -> None:
        """The server-wide state (health, stats, metrics) follows a loaded engine."""
        assert self.base is not None
        self.base.engine = engine

    async def _ttl_loop(self, ttl_s: float) -> None:
        while True:
            await asyncio.sleep(min(TTL_POLL_MAX_S, ttl_s / 4))
            now = time.monotonic()
            for entry in list(self.entries.values()):
                if (entry.state == "loaded" and not entry.pinned and not entry.busy
                        and now - entry.last_used >= ttl_s):
                    async with self._lock:
                        if entry.state == "loaded" and not entry.busy:
                            await self._unload(entry, reason="idle")

    # ---- views -----------------------------------------------------------------------
    def totals(self) -> EngineTotals:
        """Every loaded model's engine summed, with the tokens unloaded ones had counted."""
        engines = [e.engine.stats for e in self.entries.values() if e.engine is not None]
        return EngineTotals.of(engines, self.retired_prompt_tokens, self.retired_generated_tokens)

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [
            {
                "id": e.id, "object": "model", "created": created, "owned_by": "mlx-headroom",
                "state": e.state, "pinned": e.pinned,
                "context_length": (e.engine.loaded.context_length
                                   if e.engine is not None and e.engine.loaded else None),
            }
            for e in self.entries.values()
        ]

    def card(self, name: str, created: int) -> dict[str, Any] | None:
        entry = self.find(name)
        if entry is None:
            return None
        return next(c for c in self.cards(created) if c["id"] == entry.id)

    def memory_json(self) -> dict[str, Any]:
        models = []
        for e in self.entries.values():
            stats = e.engine.stats if e.engine is not None and e.state == "loaded" else None
            models.append({
                "id": e.id, "state": e.state, "pinned": e.pinned, "loads": e.loads,
                "weight_bytes": e.weight_bytes if stats else 0,
                "load_bytes": e.load_bytes if stats else 0,
                "kv_bytes": stats.kv_bytes if stats else 0,
                "kv_pool_bytes": stats.kv_pool_bytes if stats else 0,
                "requests": (e.engine.in_flight if stats and e.engine else 0),
                "leases": e.leases,
                "idle_s": round(time.monotonic() - e.last_used, 3) if e.last_used else None,
                "load_check": fit_json(e.admission.report) if e.admission else None,
            })
        return {
            "models": models,
            "pending_bytes": self.shared.snapshot(),
            "refusals": self.refusals,
            "unloads": [dataclasses.asdict(u) | {"freed_bytes": u.freed_bytes}
                        for u in self.unloads],
        }


class ModelLeaseMiddleware:
    """Holds each request's model leases until its response has been sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: list[ModelEntry] = []
        token = _leases.set(held)
        try:
            await self.app(scope, receive, send)
        finally:
            _leases.reset(token)
            ModelPool.release(held)


async def pooled_state(request: Any, name: str) -> ServerState | None:
    """For a route: the state serving `name` when several models are configured (404 for
    a model outside them, 507 when it cannot be made to fit), else None."""
    pool: ModelPool | None = getattr(request.app.state, "model_pool", None)
    return None if pool is None else await pool.resolve(name)


def check_served_model(state: ServerState, name: str) -> None:
    """The OpenAI APIs' 404 for a model this server does not serve."""
    if not state.serves(name):
        raise NotFound(
            f"The model '{name}' does not exist; this server serves '{state.model_name}'",
            code="model_not_found", param="model",
        )


async def serving_state(
    request: Any, name: str, check_model: Callable[[ServerState, str], None]
) -> ServerState:
    """For a route: the state that serves `name`, the pool's when several models are
    configured, else the server's own once `check_model` accepts the name (each API words
    its own 404)."""
    pooled = await pooled_state(request, name)
    if pooled is not None:
        return pooled
    state = get_state(request)
    check_model(state, name)
    return state
