"""Operational routes: health, version, the memory guard and the live memory view."""

from __future__ import annotations

import os
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine import backend_name
from engine.wired import WIRED
from memory import Tier
from server.errors import BadRequest, ServiceUnavailable
from server.malloc import running_allocator
from server.mlx_env import reported
from server.model_fit import fit_json
from server.schemas import MemoryGuardUpdate
from server.state import ServerState, get_state

router = APIRouter()


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = get_state(request)
    ok = state.ready and not state.shutting_down
    body = {"status": "ok" if ok else "unavailable", "model_loaded": state.engine.loaded is not None,
            "engine_alive": state.engine.alive, "memory_probe": state.guard.probe_status()}
    reason = state.engine.death_reason
    if reason is not None and not state.engine.alive:  # a supervisor's logs say why, not only that
        body["engine_error"] = reason
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/v1/version")
async def get_version() -> dict[str, Any]:
    return {
        "version": os.environ.get("MLX_HEADROOM_VERSION") or _version("mlx-headroom"),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "backend": backend_name(),
        "malloc": running_allocator(),  # "jemalloc" or "system" (server.malloc)
        "mlx_env": reported(os.environ),  # MLX settings the server defaults (server.mlx_env)
    }


def _guard_state(request: Request) -> dict[str, Any]:
    s = get_state(request).guard.state()
    return {"enabled": s.enabled, "tier": s.tier.value, "ceiling_bytes": s.ceiling_bytes}


@router.get("/v1/memory-guard")
async def get_memory_guard(request: Request) -> dict[str, Any]:
    return _guard_state(request)


@router.put("/v1/memory-guard")
async def put_memory_guard(update: MemoryGuardUpdate, request: Request) -> dict[str, Any]:
    guard = get_state(request).guard
    try:
        guard.configure(
            enabled=update.enabled,
            tier=Tier(update.tier) if update.tier is not None else None,
            ceiling_bytes=update.ceiling_bytes,
        )
    except ValueError as exc:
        raise BadRequest(str(exc), code="invalid_memory_guard", param="tier") from exc
    # MLX's cache limit follows the ceiling: the engine re-derives it between two steps.
    await get_state(request).engine.follow_memory_policy()
    return _guard_state(request)


@router.get("/v1/memory")
async def memory_view(request: Request) -> dict[str, Any]:
    state = get_state(request)
    guard = state.guard
    try:
        snapshot = guard.snapshot()
    except Exception as exc:  # a failing probe is reported, not a 500
        raise ServiceUnavailable(f"memory probe unavailable: {exc!r}",
                                 code="memory_probe_unavailable",
                                 headers={"Retry-After": "5", "x-should-retry": "true"}) from exc
    ceiling = guard.ceiling(snapshot)
    stats = state.engine.stats
    prefix = stats.prefix_cache
    body = {
        "platform": snapshot.platform,
        # What the device (or OS) counts for this process, MLX's cache and CUDA's pool
        # included, and where that figure came from; admission counts the same number.
        "usage_bytes": snapshot.footprint_bytes,
        "usage_source": snapshot.usage_source,
        "footprint_bytes": snapshot.footprint_bytes,
        "allocator": {
            "active_bytes": snapshot.allocator_active_bytes,
            "cache_bytes": snapshot.allocator_cache_bytes,
            "peak_bytes": stats.peak_bytes,
            "cache_limit_bytes": stats.cache_limit_bytes,
            # mx.set_wired_limit as this process set it for the weights (engine.wired);
            # null where it is a no-op (Linux, CUDA)
            "wired_limit_bytes": WIRED.reported_limit_bytes(),
            # held but counted by neither active nor cache (the CUDA context and pool)
            "untracked_bytes": snapshot.untracked_bytes,
            "reclaimable_bytes": snapshot.allocator_cache_bytes
            + guard.untracked_excess_bytes(snapshot),
            "hand_backs": guard.hand_backs,
        },
        "system": {
            "total_bytes": snapshot.total_bytes,
            "free_bytes": snapshot.free_bytes,
            "inactive_bytes": snapshot.inactive_bytes,
            "active_bytes": snapshot.active_bytes,
            "wired_bytes": snapshot.wired_bytes,
            "device_cap_bytes": snapshot.device_cap_bytes,
        },
        "guard": _guard_state(request),
        "ceiling": {
            "hard_bytes": ceiling.hard_bytes,
            "binding": ceiling.binding,
            "tier": ceiling.tier.value,
            "components": dict(ceiling.components),
            "fixed_bytes": ceiling.fixed_bytes,
            "fixed_binding": ceiling.fixed_binding,
        },
        "model": _model_view(state),
        **({"models": pool.memory_json()}
           if (pool := getattr(request.app.state, "model_pool", None)) is not None else {}),
        "committed_bytes": stats.committed_bytes,
        "kv_bytes": stats.kv_bytes,
        "kv": {
            "reserved_bytes": stats.kv_reserved_bytes,
            "used_bytes": stats.kv_used_bytes,
            "bytes_per_token": stats.kv_bytes_per_token,
            "pool_bytes": stats.kv_pool_bytes,
            "block_size": stats.kv_block_size,
            "segments": stats.kv_segments,
            "bits": stats.kv_bits,
            "group_size": stats.kv_group_size,
            # the paged store's layer groups: window layers hold a ring of blocks each
            "layer_groups": list(stats.kv_layer_groups),
            # a hybrid's recurrent state per sequence, held beside its blocks (counted in reserved_bytes)
            "state_bytes": stats.kv_state_bytes,
        },
        "prefix_cache": {
            "bytes": prefix.bytes if prefix else 0,
            "entries": prefix.entries if prefix else 0,
            "hits": prefix.hits if prefix else 0,
            "misses": prefix.misses if prefix else 0,
            "hit_tokens": prefix.hit_tokens if prefix else 0,
            "evictions": prefix.evictions if prefix else 0,
            "evictions_by_cause": prefix.evictions_by_cause if prefix else {},
            # an operator's cap, or null: the guard governs, and the cache may hold budget_bytes
            "max_bytes": prefix.max_bytes if prefix else None,
            "budget_bytes": stats.prefix_budget_bytes,
            **({"disk": prefix.disk} if prefix and prefix.disk else {}),
        },
        "queue": {"waiting": stats.waiting, "prefilling": stats.prefilling, "running": stats.running},
        "engine": {k: v for k, v in asdict(stats).items() if k not in ("prefix_cache", "recent_chunks")},
        "decisions": [
            {
                "at": d.at,
                "request_id": d.request_id,
                "outcome": d.outcome.value,
                "reason": d.reason,
                "code": d.code or None,
                "needed_bytes": d.needed_bytes,
                "predicted_bytes": d.predicted_bytes,
                "bytes_to_free": d.bytes_to_free,
                "limit_bytes": d.limit_bytes,
                "binding": d.binding,
            }
            for d in guard.recent_decisions()
        ],
    }
    group = getattr(request.app.state, "tensor_parallel", None)
    if group is not None:
        body["tensor_parallel"] = _ranks_view(group, guard)
    return body


def _ranks_view(group: Any, guard: Any) -> dict[str, Any]:
    """Every rank's usage against the ceiling, and the rank admission decides on: the one
    with the least room (the top-level figures above are that rank's)."""
    readings = group.readings()
    ranks = []
    for r in readings:
        ceiling = guard.ceiling(r.snapshot)
        ranks.append({
            "rank": r.rank,
            "usage_bytes": r.snapshot.footprint_bytes,
            "usage_source": r.snapshot.usage_source,
            "ceiling_bytes": ceiling.hard_bytes,
            "binding": ceiling.binding,
            "headroom_bytes": r.headroom_bytes,
        })
    return {"size": len(ranks), "binding_rank": group.binding_rank(readings), "ranks": ranks}


def _model_view(state: ServerState) -> dict[str, Any]:
    """The model's weights and reserved context, and whether load admission's reserve was
    met (``reserve_met`` false with ``forced`` true: started with --force-load)."""
    loaded = state.engine.loaded
    admission = state.load_admission
    view: dict[str, Any] = {
        "name": state.model_name,
        "weight_bytes": loaded.weight_bytes if loaded else None,
        "context_length": loaded.context_length if loaded else None,
        "fused_projection_groups": loaded.fused_groups if loaded else None,
        "reserve_context_tokens": None,
        "reserve_met": None,
        "forced": False,
        "load_check": None,
    }
    if admission is not None:
        report = admission.report
        view |= {
            "reserve_context_tokens": report.load.reserve_tokens,
            "reserve_met": admission.reserve_met,
            "forced": admission.forced,
            "load_check": {"enforced": admission.checked, **fit_json(report)},
        }
    return view
