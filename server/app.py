"""The FastAPI application: wiring settings, the memory guard and the engine together."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.middleware.cors import CORSMiddleware

from engine import EngineClient, LoadedModel, load_model
from memory import Probe
from server import anthropic
from server.access_log import AccessLogMiddleware
from server.admin_routes import router as admin_router
from server.auth import AuthMiddleware
from server.engine_config import engine_config, make_guard
from server.errors import install_error_handlers
from server.history import History
from server.host_guard import HostGuardMiddleware, HostPolicy
from server.limits import BodyLimitMiddleware
from server.malloc import running_allocator
from server.metrics import Metrics
from server.metrics import router as metrics_router
from server.model_fit import LoadAdmission
from server.model_pool import ModelLeaseMiddleware, ModelPool, wants_pool
from server.models_routes import router as models_router
from server.openai_routes import router as openai_router
from server.openapi_doc import install_openapi_errors
from server.responses import router as responses_router
from server.settings import Settings
from server.state import ServerState
from server.stats import LatencyWindow, one_engine, read_sample
from server.stats import router as stats_router

log = logging.getLogger("mlx_headroom.server")

def dashboard_dir() -> Path | None:
    """The dashboard's static files: package data in an installed wheel (`server/dashboard/`,
    see setup.py), else the source tree's top-level `dashboard/`."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "dashboard", here.parent / "dashboard"):
        if (candidate / "index.html").is_file():
            return candidate
    return None


DASHBOARD_DIR = dashboard_dir()


def create_app(
    settings: Settings | None = None,
    *,
    probe: Probe | None = None,
    load: Callable[[], LoadedModel] | None = None,
    load_admission: LoadAdmission | None = None,
    on_engine_death: Callable[[BaseException], None] | None = None,
    make_core: Callable[..., Any] | None = None,
    group: Any = None,
) -> FastAPI:
    """The app. `on_engine_death` runs on the event loop when the engine thread dies (the
    CLI stops the server and exits non-zero, so a supervisor restarts it)."""
    settings = settings or Settings()
    guard = make_guard(settings, probe)
    pool = ModelPool(settings, guard, on_death=on_engine_death) if wants_pool(settings) else None
    engine = EngineClient(
        load=load or (lambda: load_model(settings.model, model_id=settings.public_model_name,
                                         load_format=settings.load_format, dtype=settings.dtype,
                                         fuse_projections=settings.fuse_projections,
                                         small_m_kernel=settings.small_m_kernel,
                                         context_length=settings.context_length)),
        guard=pool.guard_for(pool.primary) if pool else guard,
        config=engine_config(settings),
        max_queue=settings.max_queue,
        on_death=on_engine_death,
        **({"make_core": make_core} if make_core is not None else {}),
    )
    state = ServerState(settings=settings, engine=engine, guard=guard, load_admission=load_admission)
    totals = pool.totals if pool is not None else one_engine(state)
    history = History(lambda: read_sample(state, totals))
    if pool is not None:
        pool.attach_primary(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        if pool is not None:
            await pool.start()
        log.info("ready: serving %s (memory allocator: %s)", state.model_name, running_allocator())
        history.start()
        yield
        await history.stop()
        state.shutting_down = True
        log.info("shutting down: finishing %d requests (grace %.0fs)",
                 engine.in_flight, settings.shutdown_grace_s)
        if pool is not None:
            await pool.shutdown(settings.shutdown_grace_s)
        await engine.shutdown(settings.shutdown_grace_s)

    app = FastAPI(title="mlx-headroom", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    app.state.model_pool = pool
    app.state.engine_totals = totals  # /v1/stats and the history count every model's engine
    app.state.tensor_parallel = group  # engine.distributed's GroupProbe on rank 0, else None
    install_error_handlers(app, render=anthropic.render)
    app.include_router(openai_router)
    app.include_router(models_router)
    app.include_router(anthropic.router)
    app.include_router(responses_router)
    install_openapi_errors(app)
    app.include_router(admin_router)
    app.include_router(metrics_router)
    app.include_router(stats_router)
    app.state.metrics = metrics = Metrics(state, totals)
    app.state.history = history
    app.state.latency = latency = LatencyWindow()

    def observe(record: dict[str, Any], scope: dict[str, Any]) -> None:
        metrics.observe(record, scope)
        latency.observe(record)

    # Outermost last: the access log sees every answer, the host guard refuses foreign
    # Hosts and Origins before anything else, CORS answers preflights before auth, and auth
    # refuses before a body is read.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       render=anthropic.render)
    app.add_middleware(AuthMiddleware, api_key=settings.api_key, admin_key=settings.admin_key,
                       render=anthropic.render)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                           allow_methods=["*"], allow_headers=["*"], expose_headers=["x-request-id"])
    app.add_middleware(HostGuardMiddleware, policy=HostPolicy.build(
        bind_host=settings.host, allowed_hosts=settings.allowed_hosts,
        cors_origins=settings.cors_origins), render=anthropic.render)
    app.add_middleware(AccessLogMiddleware, log_prompts=settings.log_prompts,
                       observe=observe)
    if pool is not None:
        app.add_middleware(ModelLeaseMiddleware)
    if DASHBOARD_DIR is not None:
        app.mount("/dashboard", StaticFiles(directory=DASHBOARD_DIR, html=True), name="dashboard")
    return app
