"""`GET /v1/stats`: what an operator needs at a glance, as one compact JSON object.

Throughput, latency percentiles, requests in flight, refusals (since start, in the last
5 minutes, the last minute's newest with its binding ceiling and shortfall), the last
prefill chunks' predicted against measured peak, and the memory history for the chart.
`/metrics` holds the same counters for Prometheus; this is shaped for the dashboard, which
would otherwise have to parse the text format and turn histogram buckets into percentiles.

Everything is read from published values (engine stats, the guard's snapshot, counts and
refusal list, the history ring); nothing here touches MLX or waits on the engine thread.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Query, Request

from engine import EngineStats
from engine.admission import ChunkSample
from memory import Decision, Outcome
from memory.decision import usage_bytes
from server.history import History, Sample
from server.state import ServerState, get_state

router = APIRouter()

THROUGHPUT_WINDOW_S = 10.0
LATENCY_WINDOW_S = 300.0
REFUSAL_WINDOW_S = 300.0
BANNER_WINDOW_S = 60.0
LATENCY_KEPT = 2048  # requests remembered for percentiles (the newest, within the window)


class LatencyWindow:
    """TTFT and time per output token of recent requests, fed by the access log."""

    def __init__(self, size: int = LATENCY_KEPT) -> None:
        self._items: deque[tuple[float, float, float | None]] = deque(maxlen=size)

    def observe(self, record: dict[str, Any]) -> None:
        ttft = record.get("ttft_s")
        if ttft is None:
            return
        completion = record.get("completion_tokens") or 0
        tpot = max(record["total_s"] - ttft, 0.0) / (completion - 1) if completion > 1 else None
        self._items.append((time.time(), float(ttft), tpot))

    def summary(self, now: float, window_s: float = LATENCY_WINDOW_S) -> dict[str, Any]:
        recent = [item for item in self._items if item[0] >= now - window_s]
        ttft = sorted(item[1] for item in recent)
        tpot = sorted(item[2] for item in recent if item[2] is not None)
        return {"window_s": window_s, "requests": len(recent),
                "ttft_s": _percentiles(ttft), "tpot_s": _percentiles(tpot)}


def _percentiles(values: list[float]) -> dict[str, float | None]:
    def rank(p: float) -> float | None:
        # nearest rank: the smallest value with at least p of them at or below it
        return round(values[max(math.ceil(p * len(values)) - 1, 0)], 6) if values else None

    return {"p50": rank(0.50), "p95": rank(0.95)}


@dataclass(frozen=True)
class EngineTotals:
    """The server's engines summed: one engine, or every model of the pool (whose token
    counters also keep what unloaded engines had counted, so rates never go negative)."""

    waiting: int = 0
    prefilling: int = 0
    running: int = 0
    committed_bytes: int = 0
    kv_bytes: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    recent_chunks: tuple[ChunkSample, ...] = ()  # the engines' newest, oldest first

    @classmethod
    def of(cls, engines: Iterable[EngineStats], retired_prompt_tokens: int = 0,
           retired_generated_tokens: int = 0) -> EngineTotals:
        engines = list(engines)
        return cls(
            waiting=sum(e.waiting for e in engines),
            prefilling=sum(e.prefilling for e in engines),
            running=sum(e.running for e in engines),
            committed_bytes=sum(e.committed_bytes for e in engines),
            kv_bytes=sum(e.kv_bytes for e in engines),
            prompt_tokens=retired_prompt_tokens + sum(e.prompt_tokens for e in engines),
            generated_tokens=retired_generated_tokens + sum(e.generated_tokens for e in engines),
            recent_chunks=tuple(sorted((c for e in engines for c in e.recent_chunks), key=lambda c: c.at)),
        )


Totals = Callable[[], EngineTotals]


def one_engine(state: ServerState) -> Totals:
    """Totals of the server's own engine (`state.engine` may be swapped: read it each time)."""
    return lambda: EngineTotals.of([state.engine.stats])


def read_sample(state: ServerState, totals: Totals) -> Sample:
    """One sample of the live state, from values the engines and guard publish."""
    guard = state.guard
    snapshot = guard.snapshot()
    ceiling = guard.ceiling(snapshot)
    stats = totals()
    counts = guard.counts()
    return Sample(
        at=round(time.time(), 3),
        usage_bytes=usage_bytes(snapshot),
        committed_bytes=stats.committed_bytes,
        ceiling_bytes=ceiling.hard_bytes,
        guard_enabled=guard.state().enabled,
        prompt_tokens=stats.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        waits=counts[Outcome.WAIT],
        rejects=counts[Outcome.REJECT],
    )


def _rate(now: Sample, then: Sample | None, field: str) -> float:
    if then is None or now.at - then.at <= 0:
        return 0.0
    return round((getattr(now, field) - getattr(then, field)) / (now.at - then.at), 2)


def _decision(d: Decision) -> dict[str, Any]:
    return {
        "at": d.at, "request_id": d.request_id, "outcome": d.outcome.value, "code": d.code or None,
        "reason": d.reason, "predicted_bytes": d.predicted_bytes, "needed_bytes": d.needed_bytes,
        "limit_bytes": d.limit_bytes, "over_bytes": max(d.needed_bytes - d.limit_bytes, 0),
        "binding": d.binding,
    }


def _history(samples: list[Sample], period_s: float) -> dict[str, Any]:
    """Columns rather than objects: 900 samples stay a few tens of kilobytes."""
    return {
        "period_s": period_s,
        "at": [s.at for s in samples],
        "usage_bytes": [s.usage_bytes for s in samples],
        "committed_bytes": [s.committed_bytes for s in samples],
        "ceiling_bytes": [s.ceiling_bytes for s in samples],
        "guard_enabled": [s.guard_enabled for s in samples],
    }


def build_stats(state: ServerState, history: History, latency: LatencyWindow,
                since: float | None, totals: Totals) -> dict[str, Any]:
    stats = totals()
    live = read_sample(state, lambda: stats)
    now = live.at
    # A window reaching back before the first sample starts at zero: the server is younger.
    zero = Sample(0, 0, 0, 0, True, 0, 0, 0, 0)
    refusal_base = history.at_or_before(now - REFUSAL_WINDOW_S) or zero
    rate_base = history.at_or_before(now - THROUGHPUT_WINDOW_S) or history.oldest()
    refusals = list(reversed(state.guard.recent_refusals()))
    latest = next((d for d in refusals if d.outcome is Outcome.REJECT), None)
    chunks = stats.recent_chunks
    guard = state.guard.state()
    return {
        "at": now,
        "uptime_s": round(now - state.started_at, 1),
        "guard": {"enabled": guard.enabled, "tier": guard.tier.value, "ceiling_bytes": guard.ceiling_bytes},
        "in_flight": {"waiting": stats.waiting, "prefilling": stats.prefilling, "running": stats.running,
                      "total": stats.waiting + stats.prefilling + stats.running},
        "throughput": {
            "window_s": THROUGHPUT_WINDOW_S,
            "prompt_tokens_per_s": _rate(live, rate_base, "prompt_tokens"),
            "generated_tokens_per_s": _rate(live, rate_base, "generated_tokens"),
            "prompt_tokens": live.prompt_tokens,
            "generated_tokens": live.generated_tokens,
        },
        "latency": latency.summary(now),
        "refusals": {
            "since_start": {"reject": live.rejects, "wait": live.waits},
            "last_5_min": {"reject": live.rejects - refusal_base.rejects,
                           "wait": live.waits - refusal_base.waits},
            "last_minute": sum(1 for d in refusals
                               if d.outcome is Outcome.REJECT and d.at >= now - BANNER_WINDOW_S),
            "latest_reject": _decision(latest) if latest is not None else None,
            "recent": [_decision(d) for d in refusals],
        },
        "chunks": {
            "ewma_bytes_per_token": chunks[-1].ewma_bytes_per_token if chunks else None,
            "recent": [{"at": c.at, "tokens": c.tokens, "predicted_bytes": c.predicted_bytes,
                        "measured_bytes": c.measured_bytes} for c in reversed(chunks)],
        },
        "history": _history(history.since(since), history.period_s),
    }


@router.get("/v1/stats")
async def get_stats(
    request: Request,
    since: float | None = Query(None, description="only history samples newer than this time"),
) -> dict[str, Any]:
    app_state = request.app.state
    return build_stats(get_state(request), app_state.history, app_state.latency, since,
                       app_state.engine_totals)
