"""Load admission: before the weights are read, does the model fit under the guard's ceiling?

``serve`` calls :func:`admit_load` before it builds the app; ``doctor`` calls
:func:`fit_for_settings`. Both come down to :func:`memory.fit.compute_fit`, with the
same settings, probe and ceiling, so what ``doctor`` promises is what ``serve`` admits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from memory import Ceiling, CeilingConfig, MemorySnapshot, Probe, Tier, compute_ceiling, detect_probe
from memory.decision import usage_bytes
from memory.estimate import ModelGeometry
from memory.fit import FitReport, ModelSpec, compute_fit
from memory.walk import EngineParams, paged_groups
from server.settings import Settings

log = logging.getLogger("mlx_headroom.server")

EXIT_DOES_NOT_FIT = 4  # distinct from 1 (engine died), 2 (bad flags), 3 (start-up failed)
EXIT_CANNOT_SIZE = 3  # the model or the machine could not be read: a failed start-up
EXIT_BAD_SETTINGS = 2  # a setting this model cannot be served with (--context-length)


class LoadRefused(Exception):
    """The model does not fit (or could not be sized) and --force-load was not given."""

    def __init__(self, message: str, exit_code: int = EXIT_DOES_NOT_FIT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class LoadAdmission:
    """The start-up verdict, kept for /v1/memory."""

    report: FitReport
    forced: bool  # loaded with --force-load although the reserve was not met
    checked: bool = True  # False when the guard is off: the numbers are informative only

    @property
    def reserve_met(self) -> bool:
        return self.report.fits


def engine_params(
    settings: Settings, backend: str, kv_bytes_per_token: int, device_bytes: int | None = None,
    geometry: ModelGeometry | None = None,
) -> EngineParams:
    """The engine's admission settings, and the KV store's block and default segment sizes
    as the engine picks them for this model and backend (`device_bytes`: the card's total
    on CUDA, which sizes segments there)."""
    from engine.core import ring_chunk_tokens
    from engine.kv.store import default_segment_tokens
    from server.engine_config import engine_config

    config = engine_config(settings)
    segment = config.kv_segment_tokens
    if segment is None:
        groups = 1
        layout = paged_groups(geometry, EngineParams(paged_windows=settings.paged_windows)) \
            if geometry is not None else None
        if layout is not None:  # window layers in groups: a block holds a group's layers
            kv_bytes_per_token, groups = layout.block_bytes_per_token, layout.blocks_per_layout
        segment = default_segment_tokens(backend, kv_bytes_per_token, device_bytes, groups=groups)
    return EngineParams(
        chunk_tokens=settings.prefill_step_size,
        min_chunk_tokens=settings.min_prefill_chunk,
        step_tokens=settings.max_step_tokens,
        backend=backend,
        kv_block_tokens=config.kv_block_size,
        kv_segment_tokens=segment,
        fuse_projections=settings.fuse_projections,
        paged_windows=settings.paged_windows,
        paged_states=settings.paged_states,
        ring_tokens=ring_chunk_tokens(config),
    )


def ceiling_for(settings: Settings, snapshot: MemorySnapshot) -> Ceiling:
    """The guard's ceiling under these settings (what ``MemoryGuard.ceiling`` computes)."""
    return compute_ceiling(
        snapshot, Tier(settings.memory_tier), CeilingConfig(), settings.memory_ceiling_bytes
    )


def read_spec(settings: Settings, model: str | None = None,
              context_length: int | None = None) -> ModelSpec:
    """The model as the engine will serve it: its KV quantized as the settings say, so
    that load admission counts the bytes the engine's store will hold, and its context the
    served one (``settings.context_length`` for the settings' own model, else
    ``context_length``)."""
    from engine.model_spec import read_model_spec

    spec = read_model_spec(
        model or settings.model, load_format=settings.load_format, dtype=settings.dtype,
        name=settings.public_model_name if model is None else model,
        context_length=settings.context_length if model is None else context_length,
    )
    if settings.kv_bits is None:
        return spec
    geometry = replace(spec.geometry, kv_bits=settings.kv_bits, kv_group_size=settings.kv_group_size)
    return replace(spec, geometry=geometry)


def fit_for_settings(
    settings: Settings,
    spec: ModelSpec,
    snapshot: MemorySnapshot,
    *,
    max_tokens: int | None = None,
) -> FitReport:
    """The fit of ``spec`` on this machine now: ``snapshot`` is this process's reading
    before any weights, so its usage is the baseline the weights come on top of."""
    from engine import backend_name

    return compute_fit(
        spec,
        ceiling_for(settings, snapshot),
        baseline_bytes=usage_bytes(snapshot),
        reserve_tokens=settings.load_reserve_tokens,
        max_tokens=max_tokens or settings.default_max_tokens,
        params=engine_params(settings, backend_name(), spec.geometry.kv_bytes_per_token,
                             snapshot.total_bytes if snapshot.platform == "cuda" else None,
                             spec.geometry),
        macos=snapshot.platform == "macos",
    )


def admit_load(settings: Settings, probe: Probe | None = None) -> LoadAdmission | None:
    """Check the model against the ceiling before loading it.

    Raises :class:`LoadRefused` with the numbers and what would fit, unless
    ``force_load`` is set (then the verdict is logged and kept for /v1/memory). With the
    guard off nothing is refused. None: the model could not be sized and is loaded unchecked.
    """
    from engine.context import ContextLengthSettingError
    from engine.model_spec import ModelSpecError

    try:
        spec = read_spec(settings)
    except ContextLengthSettingError as exc:  # refused whatever the guard: not a memory question
        raise LoadRefused(str(exc), EXIT_BAD_SETTINGS) from exc
    except ModelSpecError as exc:
        if settings.force_load or not settings.memory_guard:
            log.warning("load admission skipped: cannot size the model before loading it: %s", exc)
            return None
        raise LoadRefused(
            f"cannot size the model before loading it: {exc}. --force-load loads it unchecked.",
            EXIT_CANNOT_SIZE,
        ) from exc
    try:
        snapshot = (probe or detect_probe(settings.memory_probe)).read()
    except Exception as exc:  # never admit blind: a probe that cannot read refuses the load
        if settings.force_load or not settings.memory_guard:
            log.warning("load admission skipped: the memory probe failed: %s", exc)
            return None
        raise LoadRefused(
            f"the memory probe {settings.memory_probe!r} cannot read this machine ({exc}); "
            "`mlx-headroom doctor` shows each probe. --force-load loads it unchecked.",
            EXIT_CANNOT_SIZE,
        ) from exc
    draft = _draft_in_use(settings) if settings.draft_model else None
    if draft is not None:  # it loads beside the model: the model must fit on top of it
        snapshot = replace(snapshot, footprint_bytes=snapshot.footprint_bytes + draft[1])
    report = fit_for_settings(settings, spec, snapshot)
    message = (draft[0] if draft else "") + report.message() + _context_advice(settings, report)
    if report.fits:
        log.info("load admission: %s", message)
        return LoadAdmission(report, forced=False, checked=settings.memory_guard)
    if not settings.memory_guard:
        log.warning("load admission (guard off, not enforced): %s", message)
        return LoadAdmission(report, forced=False, checked=False)
    if settings.force_load:
        log.warning("--force-load: loading although the reserve is not met: %s", message)
        return LoadAdmission(report, forced=True)
    raise LoadRefused(message)


def _context_advice(settings: Settings, report: FitReport) -> str:
    """When the reserve that does not fit is a --context-length's whole: the context that
    would (its reserve then the same walk's longest admitted one)."""
    context = settings.context_length
    if report.fits or context is None or settings.reserve_context_tokens is not None:
        return ""
    if not 0 < report.max_reserve_tokens < context:
        return ""
    return (f" The reserve is the whole --context-length {context}; a context that fits: "
            f"--context-length {report.max_reserve_tokens}.")


def _draft_in_use(settings: Settings) -> tuple[str, int] | None:
    """The draft model's weights and its KV for the load reserve, as bytes the model loads
    beside, with the sentence that says so; None (and a warning) when it cannot be sized."""
    from engine.model_spec import ModelSpecError
    from memory.estimate import kv_cache_bytes

    assert settings.draft_model is not None
    try:
        draft = read_spec(settings, settings.draft_model)
    except ModelSpecError as exc:
        log.warning("load admission does not count the draft model: cannot size it (%s)", exc)
        return None
    tokens = min(settings.load_reserve_tokens, draft.context_length)
    kv = kv_cache_bytes(draft.geometry, tokens)
    note = (f"with the draft model {settings.draft_model} (its weights {_mib(draft.weight_bytes)} and KV "
            f"for {tokens} reserved tokens {_mib(kv)} counted as in use): ")
    return note, draft.weight_bytes + kv


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def fit_json(report: FitReport) -> dict[str, Any]:
    """The report as JSON: exact bytes, for /v1/memory and ``doctor --json``."""
    load = report.load
    return {
        "fits": report.fits,
        "fits_at_all": report.fits_at_all,
        "required_bytes": load.total_bytes,
        "shortfall_bytes": report.shortfall_bytes,
        "baseline_bytes": load.baseline_bytes,
        "weight_bytes": load.weight_bytes,
        "reserve_context_tokens": load.reserve_tokens,
        "reserve_kv_bytes": load.reserve_kv_bytes,
        "margin_bytes": load.margin_bytes,
        "fusion_bytes": load.fusion_bytes,
        "ceiling": {
            "hard_bytes": report.ceiling.hard_bytes,
            "binding": report.ceiling.binding,
            "components": dict(report.ceiling.components),
        },
        "max_tokens": report.max_tokens,
        "max_prompt_tokens": report.max_prompt_tokens,
        "concurrency": [
            {"prompt_tokens": c.prompt_tokens, "max_tokens": c.max_tokens,
             "requests": c.requests, "beyond_context": c.beyond_context}
            for c in report.concurrency
        ],
        "max_reserve_tokens": report.max_reserve_tokens,
        "quantized": [
            {"bits": q.quantization.bits, "group_size": q.quantization.group_size,
             "weight_bytes": q.weight_bytes, "fits": q.fits}
            for q in report.quantized
        ],
        "wired_limit_mb": report.wired_limit_mb,
        "message": report.message(),
    }
