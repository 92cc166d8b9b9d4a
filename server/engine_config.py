"""The server's settings as the values the layers below take: the engine's `EngineConfig`,
a tensor-parallel group's `GroupConfig`, and the memory guard. The app, the model pool and
the CLI all build their engines from here, so none of them imports another for it."""

from __future__ import annotations

from engine import EngineConfig
from engine.distributed.config import GroupConfig
from engine.speculative import SpeculativeConfig
from memory import MemoryGuard, Probe, ResilientProbe, Tier, detect_probe
from server.settings import Settings


def engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(
        prefill_step_size=settings.prefill_step_size,
        max_concurrency=settings.max_concurrency,
        wait_timeout_s=settings.memory_wait_timeout_s,
        prefix_cache_bytes=settings.prefix_cache_bytes,
        prefix_cache_dir=settings.prefix_cache_dir,
        prefix_cache_disk_bytes=settings.prefix_cache_disk_bytes,
        min_chunk_tokens=settings.min_prefill_chunk,
        max_step_tokens=settings.max_step_tokens,
        prefill_batch=settings.prefill_batch,
        max_decode_stall_s=settings.max_decode_stall_ms / 1000 or None,
        compile_decode=settings.compile_decode,
        prefill_key_bucket=settings.prefill_key_bucket,
        prefill_plan_ms=settings.prefill_plan_ms,
        plan_ahead=settings.plan_ahead,
        slice_decode=settings.slice_decode,
        warm_up=settings.warm_up,
        gil_switch_interval_s=settings.gil_switch_interval_ms / 1000,
        kv_bits=settings.kv_bits,
        kv_group_size=settings.kv_group_size,
        paged_windows=settings.paged_windows,
        paged_gather=settings.paged_gather,
        paged_states=settings.paged_states,
        speculative=SpeculativeConfig(settings.speculative, settings.num_speculative_tokens,
                                      settings.speculative_max_rows, draft_model=settings.draft_model,
                                      draft_dtype=settings.dtype),
    )


def group_config(settings: Settings) -> GroupConfig:
    return GroupConfig(
        model=settings.model,
        model_id=settings.public_model_name,
        ranks=settings.tensor_parallel,
        hostfile=settings.hostfile,
        backend=settings.backend,
        port=settings.tp_port,
        timeout_s=settings.tp_timeout_s,
        memory_probe=settings.memory_probe,
        load_format=settings.load_format,
        dtype=settings.dtype,
        shutdown_grace_s=settings.shutdown_grace_s,
        log_level=settings.log_level,
        context_length=settings.context_length,
    )


def make_guard(settings: Settings, probe: Probe | None = None) -> MemoryGuard:
    return MemoryGuard(
        ResilientProbe(probe or detect_probe(settings.memory_probe),
                       grace_s=settings.memory_probe_grace_s),
        enabled=settings.memory_guard,
        tier=Tier(settings.memory_tier),
        custom_ceiling_bytes=settings.memory_ceiling_bytes,
        max_reading_age_s=settings.memory_reading_max_age_s,
    )
