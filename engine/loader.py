"""Loading a model on the engine thread: a local mlx-lm directory, a hub id, or the default."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.cache_layout import CacheLayout, geometry_for, probe_cache_layout
from engine.context import context_limits
from engine.fusion import fuse_projections as fuse
from engine.kv import KVGeometry
from engine.kv.attention import attends_through_shared_sdpa
from engine.named_models import resolve_source
from memory import ModelGeometry

log = logging.getLogger("mlx_headroom.engine")

DEFAULT_MODEL = "default"


def backend_name() -> str:
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return "cpu"


def on_cuda_by_default(setting: bool | None, backend: str) -> bool:
    """A switch left unset (None) is on where it was measured to pay, CUDA, and off on the
    backends where it was not (decode overlap, compiled decode, the start-up warm-up)."""
    return backend == "cuda" if setting is None else setting


def device_memory_bytes() -> int | None:
    """The CUDA card's total memory (None elsewhere): it sizes the KV store's segments."""
    if backend_name() != "cuda":
        return None
    return int(dict(mx.device_info()).get("total_memory", 0)) or None


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer: Any  # mlx_lm TokenizerWrapper
    model_id: str
    path: str
    geometry: ModelGeometry
    backend: str
    context_length: int
    weight_bytes: int
    fused_groups: int = 0  # projection groups fused into one matmul at load (engine.fusion)
    layout: CacheLayout | None = None  # what its caches hold (None: probed when first asked)

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def cache_layout(self) -> CacheLayout:
        """The model's caches as mlx-lm builds them (`engine.cache_layout`)."""
        if self.layout is not None:
            return self.layout
        return probe_cache_layout(self.model, weights_loaded=True)

    def kv_geometry(self, windows: bool = True, gather: bool = True,
                    states: bool = True) -> KVGeometry | None:
        """The paged KV store's shape, read from the model's caches: plain `KVCache`s of the
        config's heads and dims, with `windows` sliding-window `RotatingKVCache`s among them,
        and with `gather` plain `KVCache`s of one shape whatever their heads and widths (MLA),
        or of the config's heads where the model computes its own scores (Gemma 2), and with
        `states` plain `KVCache`s among recurrent-state entries (hybrids, `engine.kv.state`).
        None for the rest (`engine.dense` serves those)."""
        layout = self.cache_layout()
        hybrid = layout.paged_states if states else None
        if hybrid is not None:
            kv = next(c for c, state in zip(layout.layers, hybrid, strict=True) if not state)
            state_bytes = sum(c.fixed_bytes for c in layout.layers if c.kind == "state")
            if kv.key_dim == kv.value_dim and attends_through_shared_sdpa(self.model) \
                    and (kv.kv_heads, kv.key_dim) == (self.geometry.num_kv_heads, self.geometry.head_dim):
                return KVGeometry(hybrid.count(False), kv.kv_heads, kv.key_dim, layout.dtype, states=hybrid,
                                  state_bytes=state_bytes)
            # MLA attention layers (bailing, Kimi): their own scores over gathered K/V, through
            # mlx-lm's shared SDPA (plamo2's own attention gave other tokens when batched)
            if gather and attends_through_shared_sdpa(self.model):
                return KVGeometry(hybrid.count(False), kv.kv_heads, kv.key_dim, layout.dtype,
                                  value_dim=kv.value_dim, gather=True, states=hybrid, state_bytes=state_bytes)
            return None
        paged_windows = layout.paged_windows if windows else None
        first = layout.layers[0] if layout.layers else None
        if first is not None and (layout.plain_kv or paged_windows is not None) \
                and (first.kv_heads, first.key_dim) == (self.geometry.num_kv_heads, self.geometry.head_dim) \
                and attends_through_shared_sdpa(self.model):
            return KVGeometry(layout.entries, first.kv_heads, first.key_dim, layout.dtype,
                              windows=paged_windows or ())
        if first is not None and gather and layout.paged_gather:
            # MLA and the like: what the cache stores is not what the config's heads attend
            # (or the model computes its scores itself, Gemma 2), so the model's own
            # attention runs on each row's gathered K/V
            return KVGeometry(layout.entries, first.kv_heads, first.key_dim, layout.dtype,
                              value_dim=first.value_dim, gather=True)
        return None


def _context_length(path: Path | None, tokenizer: Any, default: int = 8192) -> int:
    if path is not None and (path / "config.json").exists():
        config = json.loads((path / "config.json").read_text())
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
            if isinstance(config.get(key), int):
                return int(config[key])
    limit = getattr(getattr(tokenizer, "_tokenizer", None), "model_max_length", None)
    return int(limit) if isinstance(limit, int) and limit < 10**8 else default


def served_context_length(path: Path | None, tokenizer: Any, requested: int | None,
                          model_id: str) -> int:
    """The context to serve: the model's own, or ``requested`` where its RoPE reaches it
    (`engine.context`; raises `ContextLengthSettingError` where it does not)."""
    config: dict[str, Any] = {}
    if path is not None and (path / "config.json").exists():
        config = json.loads((path / "config.json").read_text())
    return context_limits(config, _context_length(path, tokenizer)).served(requested, model=model_id)


def load_model(
    model: str = DEFAULT_MODEL,
    *,
    model_id: str | None = None,
    load_format: str = "auto",
    dtype: str | None = None,
    fuse_projections: bool = True,
    small_m_kernel: bool = False,
    context_length: int | None = None,
    progress: Callable[[str], None] = log.info,
) -> LoadedModel:
    """Load ``model`` for serving; ``context_length``: serve it at that context instead of
    its own (lower, or higher where its RoPE scaling reaches; `engine.context`);
    ``small_m_kernel``: on CUDA, quantized products of few rows may take `engine.qmm_cuda`
    where it times faster than MLX's (`engine.qmm_choice`)."""
    import mlx_lm

    # it subclasses mlx-lm's MoE layer: imported at use
    from engine.quantized import default_dequantize_rows, flatten_quantized, largest_dequantized_bytes

    started = time.monotonic()
    if load_format == "dummy":
        from engine.dummy_model import load_dummy_model

        name = model_id or model
        progress(f"building dummy model {name} (random weights, dtype {dtype or 'default'})")
        dummy = load_dummy_model(model, dtype=dtype)
        source, loaded_model, tokenizer = str(dummy.path), dummy.model, dummy.tokenizer
    else:  # a named model (tiny, gemma-3-270m, default), a GGUF file, a directory, a hub id
        source, public = resolve_source(model, progress=progress)
        name = model_id or public
    if load_format != "dummy":
        progress(f"loading model {name} from {source}")
        loaded_model, tokenizer = mlx_lm.load(source)
    mx.eval(loaded_model.parameters())
    fused = fuse(loaded_model).groups if fuse_projections else 0
    backend = backend_name()
    # after fusion: its fused copies are swapped too
    flat = flatten_quantized(loaded_model, dequantize_rows=default_dequantize_rows(backend))
    if flat and backend == "cuda" and small_m_kernel:
        from engine.qmm_choice import choose_small_m

        try:
            chosen = choose_small_m(loaded_model)
        except RuntimeError as e:  # a kernel that does not build here: MLX's product everywhere
            chosen = []
            log.warning("small-M quantized kernel not used: %s", e)
        if chosen:
            progress(f"small-M quantized kernel timed on {len(chosen)} weight shapes; taken at rows "
                     + ", ".join(f"{c.out_features}x{c.in_features}: {sorted(c.points) or 'none'}"
                                 for c in chosen))
    path = Path(source) if Path(source).exists() else None
    if path is None:
        from mlx_lm.utils import _download

        path = Path(_download(source))
    layout = probe_cache_layout(loaded_model, weights_loaded=True)
    geometry = geometry_for(loaded_model, layout)
    if flat:
        geometry = replace(geometry, prefill_weight_bytes=largest_dequantized_bytes(
            loaded_model, geometry.dtype_bytes))
    weight_bytes = sum(v.nbytes for _, v in _flatten(loaded_model.parameters()))
    loaded = LoadedModel(
        model=loaded_model,
        tokenizer=tokenizer,
        model_id=name,
        path=str(path),
        geometry=geometry,
        backend=backend,
        context_length=served_context_length(path, tokenizer, context_length, name),
        weight_bytes=weight_bytes,
        fused_groups=fused,
        layout=layout,
    )
    progress(
        f"loaded {name} in {time.monotonic() - started:.1f}s: {weight_bytes / 2**20:.1f} MiB of "
        f"weights, {geometry.num_layers} layers, context {loaded.context_length}, "
        f"backend {loaded.backend}, {fused} projection groups fused, caches: {layout.describe()}"
        + (f", {flat} quantized projections flattened" if flat else "")
    )
    return loaded


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return list(tree_flatten(tree))
