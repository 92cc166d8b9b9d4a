"""`--load-format dummy`: shapes from presets, seeded random weights, a real server on them."""

from __future__ import annotations

from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.dummy_model import PRESETS, dummy_config, load_dummy_model, save_dummy_model, weight_bytes
from engine.loader import load_model
from memory.estimate import geometry_from_config
from tests.conftest import ServerProcess


@pytest.mark.parametrize(
    ("preset", "layers", "kv_heads", "head_dim", "vocab", "weights"),
    [
        ("llama3-8b", 32, 8, 128, 128256, 16_060_522_496),
        ("qwen2.5-7b", 28, 4, 128, 152064, 15_231_233_024),
    ],
)
def test_preset_shapes(preset: str, layers: int, kv_heads: int, head_dim: int, vocab: int,
                       weights: int) -> None:
    config = dummy_config(preset)
    assert config["torch_dtype"] == "bfloat16"
    g = geometry_from_config(config, dtype_bytes=2)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.vocab_size) == (layers, kv_heads, head_dim, vocab)
    assert weight_bytes(config) == weights  # computed from lazily initialised layers: no allocation


def test_config_path_and_bad_names(tmp_path: Path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    assert dummy_config(str(tmp_path), "float16")["hidden_size"] == PRESETS["tiny"]["hidden_size"]
    with pytest.raises(ValueError, match="neither a preset"):
        dummy_config("no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        dummy_config("tiny", "int8")


def test_tiny_loads_with_the_preset_geometry() -> None:
    loaded = load_model("tiny", load_format="dummy", dtype="float32")
    expected = geometry_from_config(dummy_config("tiny"), dtype_bytes=4)
    assert loaded.geometry == expected
    assert loaded.context_length == PRESETS["tiny"]["max_position_embeddings"]
    assert loaded.tokenizer.eos_token_ids == {258}
    messages = [{"role": "user", "content": "hi"}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    logits = loaded.model(mx.array([ids]))
    assert bool(mx.isfinite(logits).all())
    assert int(mx.argmax(logits[0, -1])) < 256  # the special tokens' output rows are zero


def test_weights_are_seeded_and_saved_as_mlx_lm_loads_them(tmp_path: Path) -> None:
    import mlx_lm

    a = dict(tree_flatten(load_dummy_model("tiny", dtype="float32", seed=1).model.parameters()))
    b = dict(tree_flatten(load_dummy_model("tiny", dtype="float32", seed=2).model.parameters()))
    assert not mx.array_equal(a["lm_head.weight"], b["lm_head.weight"])
    path = save_dummy_model(tmp_path / "m", "tiny", "float32", seed=1)
    model, tokenizer = mlx_lm.load(str(path))
    saved = dict(tree_flatten(model.parameters()))
    assert saved.keys() == a.keys()
    assert all(mx.array_equal(saved[k], a[k]) for k in a)
    assert tokenizer.eos_token_ids == {258}


def test_server_generates_on_a_dummy_model(tmp_path: Path) -> None:
    server = ServerProcess(Path("tiny"), args=["--load-format", "dummy", "--dtype", "float32"])
    server.start(tmp_path)
    try:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "mlx-headroom/tiny-chat", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "hello"}],
        })
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        assert server.stop() == 0
