"""Loading one rank's shard of the model: lazily, sharded with mlx-lm's `shard()`, then
evaluated, so that no rank ever holds the whole model.

mlx-lm's `sharded_load` ends with a barrier that all-sums on a CPU stream, which the NCCL
backend lacks ("There is no Stream(gpu, 1) in current thread"), so this goes around it:
`load_model(path, lazy=True)`, `model.shard(group)`, `mx.eval(model.parameters())`.
Dummy weights are drawn lazily from the same seed on every rank and sharded before they
are evaluated, so each rank computes only its own part and the group's model is the
single-device dummy model, split.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from engine.loader import LoadedModel, backend_name, served_context_length
from memory import ModelGeometry, geometry_from_model

log = logging.getLogger("mlx_headroom.distributed")


def rank_geometry(full: ModelGeometry, size: int) -> ModelGeometry:
    """What one rank holds: attention heads, KV heads and the MLP split `size` ways
    (mlx-lm's `shard()` splits exactly these; embeddings and norms stay whole)."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(full, name) % size:
            raise ValueError(f"{name}={getattr(full, name)} does not split across {size} ranks")
    return dataclasses.replace(
        full,
        num_heads=full.num_heads // size,
        num_kv_heads=full.num_kv_heads // size,
        intermediate_size=full.intermediate_size // size,
    )


def _evaluate(model: Any) -> int:
    """Evaluate the parameters one by one (a single graph would hold every temporary at
    once) and return the bytes this rank now holds."""
    total = 0
    for _, w in tree_flatten(model.parameters()):
        mx.eval(w)
        total += w.nbytes
    return total


def _dummy(model: str, dtype: str | None, group: mx.distributed.Group) -> tuple[Any, Any, Path]:
    from mlx_lm.utils import _get_classes, load_tokenizer

    from engine.dummy_model import _files_dir, dummy_config, random_weights

    config = dummy_config(model, dtype)
    model_class, args_class = _get_classes(config)
    built = model_class(args_class.from_dict(config))
    weights = random_weights(built, str(config["torch_dtype"]), seed=0)  # lazy: nothing drawn yet
    built.update(tree_unflatten(list(weights.items())))
    built.shard(group)
    path = _files_dir(config)
    return built, load_tokenizer(path, eos_token_ids=config["eos_token_id"]), path


def _from_disk(source: str, group: mx.distributed.Group) -> tuple[Any, Any, Path]:
    from mlx_lm.utils import _download, load_model, load_tokenizer

    path = Path(source) if Path(source).exists() else Path(_download(source))
    built, config = load_model(path, lazy=True)
    built.shard(group)
    eos = config.get("eos_token_id")
    return built, load_tokenizer(path, eos_token_ids=eos), path


def load_sharded(
    model: str,
    group: mx.distributed.Group,
    *,
    model_id: str | None = None,
    load_format: str = "auto",
    dtype: str | None = None,
    context_length: int | None = None,
    progress: Callable[[str], None] = log.info,
) -> LoadedModel:
    started = time.monotonic()
    rank, size = group.rank(), group.size()
    if load_format == "dummy":
        name = model_id or model
        built, tokenizer, path = _dummy(model, dtype, group)
    else:
        from engine.named_models import resolve_source

        source, public = resolve_source(model, progress=progress)  # tiny, gemma, a GGUF file...
        name = model_id or public
        built, tokenizer, path = _from_disk(source, group)
    if not hasattr(built, "shard"):
        raise ValueError(f"{name}: mlx-lm's model class has no shard(); it cannot be split")
    weight_bytes = _evaluate(built)
    built.eval()
    geometry = rank_geometry(geometry_from_model(built), size)
    loaded = LoadedModel(
        model=built, tokenizer=tokenizer, model_id=name, path=str(path), geometry=geometry,
        backend=backend_name(), context_length=served_context_length(path, tokenizer, context_length, name),
        weight_bytes=weight_bytes,
    )
    progress(f"rank {rank}/{size}: loaded its shard of {name} in {time.monotonic() - started:.1f}s: "
             f"{weight_bytes / 2**20:.1f} MiB of weights, {geometry.num_kv_heads} KV heads")
    return loaded
