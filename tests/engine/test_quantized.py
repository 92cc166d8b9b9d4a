"""Quantized weights: the engine's projections see one matrix of rows in a decode step
(engine.quantized), and that changes no token: greedy output equals mlx-lm's own
generation on the same quantized weights, alone and batched."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest

from engine import EngineRequest, SamplingParams, load_model

PROMPTS = [(5, 12), (70, 9), (23, 16)]  # (prompt tokens, new tokens)


@pytest.fixture(scope="module")
def quantized_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("quantized") / "tiny-4bit"
    convert(str(tiny_model_path), str(out), quantize=True, q_group_size=32, q_bits=4)
    return out


@pytest.fixture(scope="module")
def quantized_loaded(quantized_path: Path):
    return load_model(str(quantized_path), model_id="tiny-4bit")


def _prompt(i: int, n: int) -> tuple[int, ...]:
    rng = random.Random(900 + i)
    return tuple(rng.randrange(0, 256) for _ in range(n))


def _mlx_lm_greedy(path: Path, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(path))
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                          sampler=lambda logits: mx.argmax(logits, axis=-1))
    return [int(token) for token, _ in steps]


def test_a_decode_steps_quantized_matmuls_see_two_dimensional_inputs(make_engine, quantized_loaded,
                                                                      monkeypatch):
    seen: list[tuple[int, ...]] = []
    original = mx.quantized_matmul

    def spy(x, *args, **kwargs):
        seen.append(tuple(x.shape))
        return original(x, *args, **kwargs)

    h = make_engine(loaded=quantized_loaded)
    h.submit(EngineRequest("q", _prompt(0, 9), 4, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.core.batch.seqs) == 1)
    monkeypatch.setattr(mx, "quantized_matmul", spy)
    h.step()  # a decode step
    monkeypatch.undo()
    assert seen, "the quantized model ran no quantized matmul"
    assert all(len(shape) == 2 for shape in seen), seen


def test_quantized_greedy_output_is_mlx_lms_alone_and_batched(make_engine, quantized_loaded,
                                                             quantized_path):
    expected = {f"q{i}": _mlx_lm_greedy(quantized_path, _prompt(i, n), m)
                for i, (n, m) in enumerate(PROMPTS)}
    for i, (n, m) in enumerate(PROMPTS):
        h = make_engine(loaded=quantized_loaded, prefix_cache_bytes=0)
        h.submit(EngineRequest(f"q{i}", _prompt(i, n), m, SamplingParams(temperature=0.0)))
        h.run_until(lambda i=i, h=h: f"q{i}" in h.out.finished)
        assert h.out.tokens[f"q{i}"] == expected[f"q{i}"]
    h = make_engine(loaded=quantized_loaded, prefix_cache_bytes=0)
    for i, (n, m) in enumerate(PROMPTS):
        h.submit(EngineRequest(f"q{i}", _prompt(i, n), m, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.out.finished) == len(PROMPTS))
    assert h.core.stats.max_batch == len(PROMPTS)
    assert h.out.tokens == expected


def test_a_tied_quantized_head_multiplies_rows_and_changes_no_token(make_engine, monkeypatch):
    """A tied model's output head is its quantized embedding (`embed_tokens.as_linear`, tiny
    qwen2 at 8 bits, group 64): flattened like the projections, token for token mlx-lm's."""
    import mlx.nn as nn

    from engine.quantized import FlatQuantizedEmbedding, flatten_quantized
    from tests.engine import tiny_archs
    from tests.engine.test_quantized_moe import _loaded
    from tests.engine.test_quantized_moe import _mlx_lm_greedy as greedy
    from tests.engine.test_quantized_moe import _prompt as vocab_prompt

    def quantized_qwen2():
        model = tiny_archs.build("qwen2")
        nn.quantize(model, group_size=64, bits=8)
        mx.eval(model.parameters())
        return model

    expected = {f"q{i}": greedy(quantized_qwen2(), vocab_prompt(i, n), m) for i, (n, m) in enumerate(PROMPTS)}
    served = quantized_qwen2()
    flatten_quantized(served)
    assert served.args.tie_word_embeddings and isinstance(served.model.embed_tokens, FlatQuantizedEmbedding)
    h = make_engine(loaded=_loaded(served, "qwen2-8bit"), prefix_cache_bytes=0)
    for i, (n, m) in enumerate(PROMPTS):
        h.submit(EngineRequest(f"q{i}", vocab_prompt(i, n), m, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.core.batch.seqs) == len(PROMPTS))
    seen: list[tuple[tuple[int, ...], int]] = []
    original = mx.quantized_matmul

    def spy(x, w, *args, **kwargs):
        seen.append((tuple(x.shape), w.shape[0]))
        return original(x, w, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    h.step()  # a decode step of all three rows
    monkeypatch.undo()
    assert all(len(shape) == 2 for shape, _ in seen), seen
    assert ((len(PROMPTS), 64), tiny_archs.VOCAB) in seen  # the head, on one row per sequence
    h.run_until(lambda: len(h.out.finished) == len(PROMPTS))
    assert h.out.tokens == expected


def test_a_prefill_sized_projection_dequantizes_its_weight_and_a_decode_step_does_not(quantized_path):
    """From `dequantize_rows` rows up, a quantized projection multiplies its dequantized
    weight (MLX's CUDA quantized product is slow for many rows); below it, and in the output
    head, it keeps the quantized product. The geometry counts the largest such weight."""
    import mlx.nn as nn
    from mlx_lm import load

    from engine.quantized import FlatQuantizedLinear, flatten_quantized, largest_dequantized_bytes

    model, _ = load(str(quantized_path))
    flatten_quantized(model, dequantize_rows=8)
    proj = model.model.layers[0].mlp.gate_proj
    assert isinstance(proj, FlatQuantizedLinear) and proj.dequantize_rows == 8
    assert model.lm_head.dequantize_rows == 0  # the head: only a scored prompt gives it many rows
    weight = mx.dequantize(proj["weight"], proj["scales"], proj["biases"], group_size=proj.group_size,
                           bits=proj.bits, dtype=mx.float32)
    for rows in (3, 8, 20):
        x = mx.random.normal((1, rows, weight.shape[1]), key=mx.random.key(rows))
        quantized = mx.quantized_matmul(x, proj["weight"], proj["scales"], proj["biases"],
                                        group_size=proj.group_size, bits=proj.bits)
        out = proj(x)
        assert out.shape == (1, rows, weight.shape[0])
        if rows >= 8:
            assert mx.array_equal(out, (x.reshape(rows, -1) @ weight.T).reshape(out.shape)).item()
        else:
            assert mx.array_equal(out, quantized).item()
        assert mx.allclose(out, quantized, atol=1e-4, rtol=1e-4).item()
    largest = max(m["weight"].shape[0] * m["weight"].shape[1] * 32 // m.bits
                  for name, m in model.named_modules()
                  if isinstance(m, nn.QuantizedLinear) and not name.endswith("lm_head"))
    assert largest_dequantized_bytes(model, 4) == 4 * largest > 0


def test_the_prefill_estimate_counts_a_dequantized_weight():
    from dataclasses import replace

    from memory.estimate import ModelGeometry, estimate_prefill

    g = ModelGeometry(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=512,
                      intermediate_size=1536, vocab_size=1000)
    plain = estimate_prefill(g, chunk_tokens=512, context_tokens=0)
    counted = estimate_prefill(replace(g, prefill_weight_bytes=3 << 20), chunk_tokens=512, context_tokens=0)
    assert counted.total_bytes - plain.total_bytes == 3 << 20


def test_dequantized_prefill_changes_no_token(make_engine, quantized_path, monkeypatch):
    """Prefill chunks through dequantized weights (every call of 4 rows or more), decode
    through the quantized product: greedy output is still mlx-lm's, alone and batched."""
    import engine.quantized

    monkeypatch.setattr(engine.quantized, "default_dequantize_rows", lambda backend: 4)
    loaded = load_model(str(quantized_path), model_id="tiny-4bit")
    assert loaded.geometry.prefill_weight_bytes > 0
    expected = {f"q{i}": _mlx_lm_greedy(quantized_path, _prompt(i, n), m) for i, (n, m) in enumerate(PROMPTS)}
    h = make_engine(loaded=loaded, prefix_cache_bytes=0)
    for i, (n, m) in enumerate(PROMPTS):
        h.submit(EngineRequest(f"q{i}", _prompt(i, n), m, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.out.finished) == len(PROMPTS))
    assert h.out.tokens == expected


def test_the_spec_sizes_a_dequantized_weight_before_loading(quantized_path, monkeypatch):
    """Load admission reads the model's spec before loading it: where the backend
    dequantizes for prefill, the spec counts a weight at least as large as the loaded
    model's largest dequantizing projection; where it does not (the CPU), none."""
    import engine.quantized
    from engine.model_spec import read_model_spec

    assert read_model_spec(str(quantized_path)).geometry.prefill_weight_bytes == 0
    monkeypatch.setattr(engine.quantized, "default_dequantize_rows", lambda backend: 256)
    spec = read_model_spec(str(quantized_path))
    loaded = load_model(str(quantized_path), model_id="tiny-4bit")
    assert spec.geometry.prefill_weight_bytes >= loaded.geometry.prefill_weight_bytes > 0
