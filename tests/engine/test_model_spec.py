"""engine.model_spec: a model's size read from its files agrees with the model once loaded."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.cache_layout import CacheLayoutError, probe_cache_layout
from engine.dummy_model import dummy_config, weight_bytes
from engine.loader import load_model
from engine.model_spec import ModelSpecError, read_model_spec
from memory import geometry_from_model
from memory.weights import Quantization
from tests.engine import tiny_archs


def test_the_default_model_is_sized_exactly_from_its_headers() -> None:
    spec = read_model_spec("tiny")
    loaded = load_model("tiny")
    assert spec.weights_source == "safetensors headers"
    assert spec.weight_bytes == loaded.weight_bytes
    assert spec.geometry == loaded.geometry
    assert spec.context_length == loaded.context_length


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_dummy_preset_is_sized_from_its_config_without_building_it(dtype: str | None) -> None:
    before = mx.get_active_memory()
    big = read_model_spec("llama3-8b", load_format="dummy", dtype=dtype)
    assert mx.get_active_memory() - before < 1 << 20  # 16 GB of weights, none allocated
    assert big.weight_bytes == weight_bytes(dummy_config("llama3-8b", dtype)) == 16_060_522_496
    assert big.context_length == 131072 and big.weights_source == "dummy config"
    tiny = read_model_spec("tiny", load_format="dummy", dtype=dtype)
    loaded = load_model("tiny", load_format="dummy", dtype=dtype)
    assert tiny.weight_bytes == loaded.weight_bytes
    assert tiny.geometry == loaded.geometry


def test_a_quantized_model_is_sized_at_its_packed_size(tmp_path: Path) -> None:
    from mlx_lm.utils import quantize_model, save_config, save_model

    source = load_model("tiny", fuse_projections=False)  # saved below under mlx-lm's own names
    config = json.loads((Path(source.path) / "config.json").read_text())
    model, config = quantize_model(source.model, config, group_size=64, bits=4)
    out = tmp_path / "tiny-4bit"
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((Path(source.path) / name).read_bytes())

    spec = read_model_spec(str(out))
    loaded = load_model(str(out))
    assert spec.weights.quantization == Quantization(4, 64)
    assert spec.weight_bytes == loaded.weight_bytes < source.weight_bytes
    assert spec.weight_bytes == sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    assert spec.geometry == geometry_from_model(loaded.model)


def test_unreadable_models_say_why(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSpecError, match=r"no \.safetensors"):
        read_model_spec(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelSpecError, match=r"config\.json"):
        read_model_spec(str(tmp_path))


def test_only_host_reads_in_the_forward_keep_a_model_from_being_probed_unloaded() -> None:
    """dbrx's router calls tolist() in its forward: probing it unloaded would evaluate its
    weights, so it is refused (naming the method). prism_hadamard_qwen35 calls item() only
    in sanitize, which the probe never runs: its caches are read lazily, nothing evaluated."""
    with pytest.raises(CacheLayoutError, match=r"dbrx\.SparseMoeBlock\.__call__"):
        probe_cache_layout(tiny_archs.build("dbrx", evaluate=False))
    before = mx.get_active_memory()
    layout = probe_cache_layout(tiny_archs.build("prism_hadamard_qwen35", evaluate=False))
    assert layout.kinds() == {"state": 2, "full": 2}
    assert mx.get_active_memory() - before < 1 << 16


def test_a_layouts_bytes_written_sum_its_entries_whatever_their_kinds() -> None:
    """The engine reports every row's written bytes at every step from one rate per window
    (`CacheLayout.bytes_used`): it must equal the entries' own figures summed, for full,
    window, chunked, state and quantized entries side by side."""
    from engine.cache_layout import CHUNKED, FULL, QUANTIZED, STATE, WINDOW, CacheLayout, LayerCache

    layers = (
        LayerCache(FULL, "KVCache", bytes_per_token=256),
        LayerCache(WINDOW, "RotatingKVCache", bytes_per_token=128, window=64),
        LayerCache(WINDOW, "RotatingKVCache", bytes_per_token=128, window=64),
        LayerCache(WINDOW, "RotatingKVCache", bytes_per_token=96, window=512),
        LayerCache(CHUNKED, "ChunkedKVCache", bytes_per_token=64, window=128),
        LayerCache(STATE, "ArraysCache", fixed_bytes=10_000),
        LayerCache(QUANTIZED, "QuantizedKVCache", bytes_per_token=40),
    )
    layout = CacheLayout(layers, entries=len(layers), vocab_size=256, dtype=mx.float32)
    for tokens in (0, 1, 63, 64, 65, 127, 128, 129, 511, 512, 513, 10_000):
        assert layout.bytes_used(tokens) == sum(c.bytes_used(tokens) for c in layers), tokens
