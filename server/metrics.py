"""`/metrics` in the Prometheus text format, from a registry of this app's own.

Request counters and latency histograms are fed by the access log's record of each
request; everything that is engine or guard state (queue depth, memory against the
ceiling, admission decisions, the prefix cache) is read live at scrape time by a
custom collector, so it can never drift from what `/v1/memory` shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.wired import WIRED
from memory import MemoryGuard
from server.state import ServerState
from server.stats import Totals

router = APIRouter()

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
UNDOCUMENTED_ENDPOINTS = frozenset({"/metrics", "/openapi.json", "/docs", "/redoc"})
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EngineCollector(Collector):
    """Gauges and counters read from the engines and the memory guard when scraped. Queue
    depth and bytes sum every model's engine; the prefix cache is the served model's."""

    def __init__(self, state: ServerState, totals: Totals) -> None:
        self.state = state
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        stats = self.state.engine.stats
        totals = self.totals()
        queue = GaugeMetricFamily("mlx_headroom_queue_depth", "requests in the engine by state",
                                  labels=["state"])
        queue.add_metric(["waiting"], totals.waiting)
        queue.add_metric(["prefilling"], totals.prefilling)
        queue.add_metric(["running"], totals.running)
        yield queue

        guard = self.state.guard
        yield from _memory_gauges(guard)
        yield from _wired_gauge()
        yield GaugeMetricFamily("mlx_headroom_committed_bytes",
                                "memory reserved for admitted requests", value=totals.committed_bytes)
        yield GaugeMetricFamily("mlx_headroom_kv_cache_bytes", "KV cache of running requests",
                                value=totals.kv_bytes)

        decisions = CounterMetricFamily("mlx_headroom_admission_decisions",
                                        "memory guard decisions by outcome", labels=["outcome"])
        for outcome, count in sorted(guard.counts().items(), key=lambda kv: kv[0].value):
            decisions.add_metric([outcome.value], count)
        yield decisions

        prefix = stats.prefix_cache
        for name, doc, value in (
            ("hits", "prefix-cache lookups that reused a cached prefix", prefix.hits if prefix else 0),
            ("misses", "prefix-cache lookups that found nothing", prefix.misses if prefix else 0),
            ("hit_tokens", "prompt tokens served from the prefix cache", prefix.hit_tokens if prefix else 0),
        ):
            yield CounterMetricFamily(f"mlx_headroom_prefix_cache_{name}", doc, value=value)
        evictions = CounterMetricFamily("mlx_headroom_prefix_cache_evictions",
                                        "prefix-cache blocks evicted from memory, by cause", labels=["cause"])
        for cause, count in (prefix.evictions_by_cause if prefix else {}).items():
            evictions.add_metric([cause], count)
        yield evictions
        yield GaugeMetricFamily("mlx_headroom_prefix_cache_bytes", "bytes held by the prefix cache",
                                value=prefix.bytes if prefix else 0)
        limit = prefix.max_bytes if prefix and prefix.max_bytes is not None else stats.prefix_budget_bytes
        yield GaugeMetricFamily("mlx_headroom_prefix_cache_max_bytes",
                                "the prefix cache's limit: an operator's cap, else what the guard leaves it",
                                value=limit)
        yield GaugeMetricFamily("mlx_headroom_prefix_cache_entries", "blocks in the prefix cache",
                                value=prefix.entries if prefix else 0)
        yield from _speculative_metrics(stats.speculative or {})


class Metrics:
    def __init__(self, state: ServerState, totals: Totals) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("mlx_headroom_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("mlx_headroom_prompt_tokens", "prompt tokens of served requests",
                                     registry=self.registry)
        self.completion_tokens = Counter("mlx_headroom_completion_tokens", "tokens generated",
                                         registry=self.registry)
        self.ttft = Histogram("mlx_headroom_time_to_first_token_seconds",
                              "from the request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("mlx_headroom_time_per_output_token_seconds",
                              "decode time per generated token after the first",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.registry.register(EngineCollector(state, totals))
        self._endpoints: frozenset[str] | None = None

    def endpoint(self, scope: dict[str, Any]) -> str:
        """The route's path when it is one of ours, so unknown paths cannot blow up labels."""
        if self._endpoints is None:
            documented = scope["app"].openapi().get("paths", {})
            self._endpoints = frozenset(documented) | UNDOCUMENTED_ENDPOINTS
        path: str = scope["path"]
        if path in self._endpoints:
            return path
        if path.startswith("/dashboard"):
            return "/dashboard"
        return "other"

    def observe(self, record: dict[str, Any], scope: dict[str, Any]) -> None:
        self.requests.labels(self.endpoint(scope), str(record["status"])).inc()
        if record["prompt_tokens"]:
            self.prompt_tokens.inc(record["prompt_tokens"])
        completion = record["completion_tokens"] or 0
        if completion:
            self.completion_tokens.inc(completion)
        ttft = record["ttft_s"]
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion > 1:
                self.tpot.observe(max(record["total_s"] - ttft, 0.0) / (completion - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _speculative_metrics(spec: dict[str, Any]) -> Iterator[Metric]:
    """Speculative decoding (engine.speculative), the served model's; zeros when it is off."""
    for name, doc, key in (
        ("drafted_tokens", "draft tokens verified", "drafted_tokens"),
        ("accepted_tokens", "draft tokens the target agreed with", "accepted_tokens"),
        ("verified_rows", "rows that verified drafts, one per row and step", "rows_verified"),
    ):
        yield CounterMetricFamily(f"mlx_headroom_speculative_{name}", doc, value=spec.get(key) or 0)
    yield GaugeMetricFamily("mlx_headroom_speculative_acceptance_rate",
                            "accepted / drafted tokens", value=spec.get("acceptance_rate") or 0)
    yield GaugeMetricFamily("mlx_headroom_speculative_tokens_per_verified_row",
                            "tokens a row emits in a step that verified its drafts",
                            value=spec.get("tokens_per_verified_row") or 0)
    yield GaugeMetricFamily("mlx_headroom_decode_tokens_per_row_step",
                            "tokens a decoding request gets per engine step (1 without speculation)",
                            value=spec.get("tokens_per_row_step") or 0)


def _wired_gauge() -> Iterator[Metric]:
    """MLX's wired limit as this process set it for the weights; absent where setting it is
    a no-op (Linux, CUDA), so a 0 always means "nothing wired" on a device that could."""
    limit = WIRED.reported_limit_bytes()
    if limit is not None:
        yield GaugeMetricFamily("mlx_headroom_wired_limit_bytes",
                                "mx.set_wired_limit as set for the loaded models' weights", value=limit)


def _memory_gauges(guard: MemoryGuard) -> Iterator[Metric]:
    """The probe's reading and the ceiling; only the probe's status while it is unavailable."""
    try:
        snapshot = guard.snapshot()
    except Exception:  # any probe failure: report it as unavailable, never a 500
        snapshot = None
    yield GaugeMetricFamily("mlx_headroom_memory_probe_available",
                            "1 while the memory probe answers (or its last reading stands in)",
                            value=0 if snapshot is None else 1)
    if snapshot is None:
        return
    ceiling = guard.ceiling(snapshot)
    yield GaugeMetricFamily("mlx_headroom_memory_usage_bytes",
                            "this process's memory use as the device counts it",
                            value=snapshot.footprint_bytes)
    yield GaugeMetricFamily("mlx_headroom_memory_footprint_bytes", "this process's footprint",
                            value=snapshot.footprint_bytes)
    yield GaugeMetricFamily("mlx_headroom_memory_ceiling_bytes", "the hard memory ceiling",
                            value=ceiling.hard_bytes)
    components = GaugeMetricFamily("mlx_headroom_memory_ceiling_component_bytes",
                                   "each limit the ceiling is the smallest of",
                                   labels=["component"])
    for name, value in sorted(ceiling.components.items()):
        components.add_metric([name], value)
    yield components
