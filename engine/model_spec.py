"""A model's :class:`~memory.fit.ModelSpec` read from its config and files, weights unread.

Load admission and ``doctor`` need the weights' bytes before anything large is allocated:

- a local mlx-lm directory (or the embedded default model): ``config.json`` and the
  safetensors headers (a few kilobytes per shard);
- a hub id already in the Hugging Face cache: the same, from the cache;
- a hub id not yet downloaded: ``config.json`` and the headers over HTTP range requests
  (``huggingface_hub.get_safetensors_metadata``), never the weights themselves;
- a GGUF file (or Gemma 3 270M from its package) not yet converted: the header's tensor
  shapes in the dtype conversion writes (``engine.gguf``); once converted, its directory;
- ``--load-format dummy``: the preset's or config's model class built with lazy parameters
  (MLX allocates nothing until evaluated), counted in the dummy dtype.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from engine.context import ContextLengthSettingError, context_limits
from memory import ModelGeometry, geometry_from_config
from memory.estimate import dense_projection_bytes
from memory.fit import ModelSpec
from memory.weights import (
    TensorInfo,
    WeightInventory,
    inventory_from_tensors,
    parse_safetensors_header,
    quantization_from_config,
    safetensors_header_length,
)

DEFAULT_CONTEXT = 8192  # the loader's fallback when neither config nor tokenizer says
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions")
_FLOAT_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "float32": 4, "float16": 2, "bfloat16": 2}


class ModelSpecError(ValueError):
    """The model's config or weight files could not be read."""


def read_model_spec(model: str, *, load_format: str = "auto", dtype: str | None = None,
                    name: str | None = None, context_length: int | None = None) -> ModelSpec:
    """The spec of what ``load_model(model, load_format=..., dtype=..., context_length=...)``
    would load, its context the one it would serve (``engine.context``: a context its RoPE
    cannot reach raises :class:`~engine.context.ContextLengthSettingError`)."""
    if load_format == "dummy":
        return _dummy_spec(model, dtype, name or model, context_length)
    from engine.gguf import GGUFError
    from engine.named_models import gguf_header, local_directory, public_name

    try:
        ready = local_directory(model)  # a named model or a GGUF already built or converted
        header = None if ready is not None else gguf_header(model)  # a GGUF not converted yet
    except (GGUFError, FileNotFoundError) as exc:
        raise ModelSpecError(str(exc)) from exc
    if ready is not None:
        return spec_from_directory(ready, name or public_name(model), context_length)
    if header is not None:  # sized from its header
        return spec_from_gguf(header, name or public_name(model), context_length)
    path = Path(model)
    if path.is_dir():
        return spec_from_directory(path, name or model, context_length)
    return _hub_spec(model, name or model, context_length)


def spec_from_directory(path: Path, name: str, context_length: int | None = None) -> ModelSpec:
    config = _read_config(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelSpecError(f"{path} holds no .safetensors weight files")
    tensors = [t for shard in shards for t in read_safetensors_tensors(shard)]
    return _spec(name, config, tensors, _context_length(path, config), "safetensors headers",
                 context_length)


def spec_from_gguf(path: Path, name: str, context_length: int | None = None) -> ModelSpec:
    """What converting the GGUF at ``path`` would load: its header's shapes in the target dtype."""
    from engine.gguf import GGUFError, mlx_config, open_gguf
    from engine.gguf.convert import weight_names
    from engine.named_models import gguf_dtype

    dtype = gguf_dtype()
    itemsize = _FLOAT_DTYPE_BYTES[dtype]
    try:
        g = open_gguf(path, header_only=True)
        config = mlx_config(g, dtype)
        tensors = [TensorInfo(hf_name, dtype, g.tensors[n].shape, g.tensors[n].elements * itemsize)
                   for n, hf_name in weight_names(g).items()]
    except GGUFError as exc:
        raise ModelSpecError(str(exc)) from exc
    return _spec(name, config, tensors, _context_length(None, config), "GGUF header",
                 context_length)


def read_safetensors_tensors(path: Path) -> list[TensorInfo]:
    """The tensors of one safetensors file, from its header alone."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelSpecError(f"{path} is not a safetensors file")
        rest = f.read(safetensors_header_length(prefix) - 8)
    try:
        return parse_safetensors_header(prefix + rest)
    except (ValueError, KeyError) as exc:
        raise ModelSpecError(f"{path}: {exc}") from exc


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelSpecError(f"cannot read {path / 'config.json'}: {exc}") from exc
    return config


def _context_length(path: Path | None, config: Mapping[str, Any]) -> int:
    """As the loader decides it: the config, else the tokenizer's limit, else 8192."""
    for key in _CONTEXT_KEYS:
        if isinstance(config.get(key), int):
            return int(config[key])
    if path is not None and (path / "tokenizer_config.json").exists():
        limit = json.loads((path / "tokenizer_config.json").read_text()).get("model_max_length")
        if isinstance(limit, int) and limit < 10**8:
            return limit
    return DEFAULT_CONTEXT


def _dtype_bytes(tensors: Iterable[TensorInfo]) -> int | None:
    """The floating-point dtype holding the most elements (the activations' dtype)."""
    by_dtype: dict[int, int] = {}
    for t in tensors:
        size = _FLOAT_DTYPE_BYTES.get(t.dtype)
        if size is not None:
            by_dtype[size] = by_dtype.get(size, 0) + t.elements
    return max(by_dtype, key=lambda k: by_dtype[k]) if by_dtype else None


def _spec(name: str, config: Mapping[str, Any], tensors: list[TensorInfo], trained: int,
          source: str, context_length: int | None) -> ModelSpec:
    context = context_limits(config, trained).served(context_length, model=name)
    try:
        geometry = _probed_geometry(config, _dtype_bytes(tensors))
    except Exception as probe_error:  # a model class mlx-lm lacks, a forward that needs weights
        try:
            geometry = geometry_from_config(config, dtype_bytes=_dtype_bytes(tensors))
        except ValueError as exc:
            raise ModelSpecError(f"{name}: {exc}; and its caches could not be probed "
                                 f"({probe_error})") from exc
    inventory: WeightInventory = inventory_from_tensors(tensors, quantization_from_config(config))
    return ModelSpec(name, _with_dequantized_prefill(geometry, inventory), inventory, context, source)


def _with_dequantized_prefill(geometry: ModelGeometry, inventory: WeightInventory) -> ModelGeometry:
    """Where this backend dequantizes quantized projections for a prefill chunk
    (`engine.quantized`), the largest such weight beside the chunk's activations."""
    from dataclasses import replace

    from engine.loader import backend_name
    from engine.quantized import default_dequantize_rows

    if inventory.quantization is None or not default_dequantize_rows(backend_name()):
        return geometry
    return replace(geometry, prefill_weight_bytes=dense_projection_bytes(geometry))


def _probed_geometry(config: Mapping[str, Any], dtype_bytes: int | None) -> ModelGeometry:
    """The geometry of the model mlx-lm would build from `config`, its caches read from a
    lazy forward of the model built with unevaluated parameters (`engine.cache_layout`):
    nothing is allocated, and models whose configs lack the usual keys (gpt2's n_head,
    mamba's state) or whose caches differ from them (MLA) are sized as they store."""
    from mlx_lm.utils import _get_classes

    from engine.cache_layout import geometry_for, probe_cache_layout
    from engine.mlx_thread import run_released

    def probe() -> ModelGeometry:
        model_class, args_class = _get_classes(dict(config))
        lazy = model_class(args_class.from_dict(dict(config)))
        return geometry_for(lazy, probe_cache_layout(lazy), dtype_bytes=dtype_bytes)

    return run_released(probe)  # the model's initialisers leave MLX state on their thread


def _dummy_spec(model: str, dtype: str | None, name: str, context_length: int | None) -> ModelSpec:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from engine.dummy_model import dummy_config
    from engine.mlx_thread import run_released

    config = dummy_config(model, dtype)
    dt = str(config["torch_dtype"])
    itemsize = getattr(mx, dt).size

    def tensors_of_lazy_model() -> list[TensorInfo]:
        model_class, args_class = _get_classes(config)
        lazy = model_class(args_class.from_dict(config))  # parameters stay unevaluated
        return [TensorInfo(n, dt, tuple(p.shape), p.size * itemsize)
                for n, p in tree_flatten(lazy.parameters())]

    tensors = run_released(tensors_of_lazy_model)
    return _spec(name, config, tensors, _context_length(None, config), "dummy config",
                 context_length)


def _complete(path: Path) -> bool:
    """Every shard the index names is there (an interrupted download would undercount)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return bool(shards) and all((path / shard).exists() for shard in shards)
    return any(path.glob("*.safetensors"))


def _hub_spec(repo: str, name: str, context_length: int | None) -> ModelSpec:
    try:
        from huggingface_hub import snapshot_download

        cached = Path(snapshot_download(repo, local_files_only=True))
        if _complete(cached):
            return spec_from_directory(cached, name, context_length)
    except ContextLengthSettingError:
        raise  # the model is there: the context asked for is what cannot be served
    except Exception:  # not in the cache: read the headers over HTTP below
        pass
    try:
        from huggingface_hub import get_safetensors_metadata, hf_hub_download

        config = json.loads(Path(hf_hub_download(repo, "config.json")).read_text())
        meta = get_safetensors_metadata(repo)
    except Exception as exc:
        raise ModelSpecError(
            f"cannot read {repo!r}: not a local directory, and its config and safetensors "
            f"headers could not be fetched from the hub ({exc})"
        ) from exc
    tensors = [
        TensorInfo(t_name, t.dtype, tuple(t.shape), int(t.data_offsets[1] - t.data_offsets[0]))
        for file_meta in meta.files_metadata.values()
        for t_name, t in file_meta.tensors.items()
    ]
    return _spec(name, config, tensors, _context_length(None, config), "safetensors headers (hub)",
                 context_length)
