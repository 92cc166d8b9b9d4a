from __future__ import annotations

from typing import Any

import pytest
from memtest_helpers import KiB, MiB

from memory import (
    KV_STEP,
    ModelGeometry,
    estimate_decode_reservation,
    estimate_prefill,
    fused_attention_available,
    geometry_from_config,
    geometry_from_model,
    kv_cache_bytes,
)

LLAMA3_8B = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def test_geometry_from_config_defaults() -> None:
    g = geometry_from_config(LLAMA3_8B)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype_bytes) == (32, 8, 128, 2)
    # 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes
    assert g.kv_bytes_per_token == 128 * KiB
    mha = geometry_from_config({**LLAMA3_8B, "num_key_value_heads": None, "torch_dtype": "float32"})
    assert (mha.num_kv_heads, mha.dtype_bytes) == (32, 4)
    assert geometry_from_config({**LLAMA3_8B, "head_dim": 64}, dtype_bytes=4).head_dim == 64
    nested = geometry_from_config({"text_config": LLAMA3_8B, "model_type": "vlm"})
    assert nested == g
    with pytest.raises(ValueError, match="vocab_size"):
        geometry_from_config({k: v for k, v in LLAMA3_8B.items() if k != "vocab_size"})


def test_geometry_from_config_reads_dbrx_names() -> None:
    """dbrx is sized from its config (its router reads values on the host, so its caches are
    not probed before load), which names the usual keys otherwise."""
    dbrx = {
        "model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40, "vocab_size": 100352,
        "attn_config": {"kv_n_heads": 8, "clip_qkv": 8, "rope_theta": 500000},
        "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4},
    }
    g = geometry_from_config(dbrx)
    assert (g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim) == (40, 48, 8, 128)
    assert (g.hidden_size, g.intermediate_size, g.vocab_size) == (6144, 10752, 100352)
    assert g.kv_bytes_per_token == 2 * 40 * 8 * 128 * 2
    assert geometry_from_config({**LLAMA3_8B, "n_heads": 1, "d_model": 1}) == geometry_from_config(LLAMA3_8B)


def test_geometry_from_config_reads_step_kv_heads() -> None:
    """Step 3.5 names its KV heads `num_attention_groups`: read as the KV heads, not the
    query heads' count (which would count twice its KV), so its caches match its config and
    the paged store holds it."""
    step = {"model_type": "step3p5", "hidden_size": 4096, "num_hidden_layers": 45, "num_attention_heads": 64,
            "num_attention_groups": 8, "head_dim": 128, "intermediate_size": 11264, "vocab_size": 128896}
    g = geometry_from_config(step)
    assert (g.num_heads, g.num_kv_heads, g.head_dim) == (64, 8, 128)
    assert geometry_from_config({**step, "num_key_value_heads": 4}).num_kv_heads == 4  # the usual key first


def test_quantized_kv_is_smaller() -> None:
    g = geometry_from_config(LLAMA3_8B)
    q8 = ModelGeometry(**{**g.__dict__, "kv_bits": 8})
    q4 = ModelGeometry(**{**g.__dict__, "kv_bits": 4})
    # 8-bit: half of bf16 plus a scale and bias (bf16) per 64 elements.
    assert q8.kv_bytes_per_token == 64 * KiB + 2 * 32 * 8 * 2 * 2 * 2
    assert q4.kv_bytes_per_token < q8.kv_bytes_per_token < g.kv_bytes_per_token
    # group 128: half the scales and biases
    q8_128 = ModelGeometry(**{**g.__dict__, "kv_bits": 8, "kv_group_size": 128})
    assert q8_128.kv_bytes_per_token == 64 * KiB + 2 * 32 * 8 * 1 * 2 * 2
    # the store decodes quantized rows before the ordinary SDPA: fused where that is
    assert fused_attention_available(q8, "metal")
    assert estimate_prefill(q8, chunk_tokens=512, context_tokens=0, backend="metal").attention_bytes > (
        estimate_prefill(g, chunk_tokens=512, context_tokens=0, backend="metal").attention_bytes)


@pytest.mark.parametrize(
    ("tokens", "batch", "slots"),
    [(0, 1, 0), (1, 1, 256), (256, 1, 256), (257, 1, 512), (300, 2, 1024)],
)
def test_kv_cache_bytes_rounds_to_steps(tokens: int, batch: int, slots: int) -> None:
    g = geometry_from_config(LLAMA3_8B)
    assert KV_STEP == 256
    assert kv_cache_bytes(g, tokens, batch) == slots * 128 * KiB


def test_decode_reservation() -> None:
    g = geometry_from_config(LLAMA3_8B)
    assert estimate_decode_reservation(g, prompt_tokens=1000, max_tokens=100) == 1280 * 128 * KiB
    assert estimate_decode_reservation(g, prompt_tokens=30_000, max_tokens=2768, batch=1) == (
        32 * 1024 * 128 * KiB  # 32k tokens = 4 GiB
    )


@pytest.mark.parametrize(
    ("head_dim", "dtype_bytes", "backend", "fused"),
    [
        (128, 2, "metal", True),
        (80, 4, "metal", True),
        (112, 2, "metal", False),
        (128, 2, "cuda", True),
        (120, 2, "cuda", True),
        (256, 2, "cuda", False),
        (128, 4, "cuda", False),  # cuDNN path is fp16/bf16 only
        (128, 2, "cpu", False),  # the CPU always materialises scores
    ],
)
def test_fused_attention_table(head_dim: int, dtype_bytes: int, backend: str, fused: bool) -> None:
    g = ModelGeometry(2, 8, 8, head_dim, 8 * head_dim, 4 * head_dim, 1000, dtype_bytes)
    assert fused_attention_available(g, backend) is fused


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_a_masked_batch_counts_its_additive_mask_and_the_boolean_it_came_from(backend) -> None:
    """On CUDA the old estimate took a masked batch for fused attention and counted no mask
    at all; three rows of 2,048 tokens over 34,816 ran the H200 out of memory there.
    The mask the engine builds is B x C x (T+C) in the activation dtype,
    plus its boolean source."""
    g = geometry_from_config(LLAMA3_8B)
    plain = estimate_prefill(g, chunk_tokens=2048, context_tokens=32768, batch=3, backend=backend)
    masked = estimate_prefill(g, chunk_tokens=2048, context_tokens=32768, batch=3, backend=backend,
                              masked=True)
    assert masked.attention_bytes - plain.attention_bytes == 3 * 2048 * 34816 * (2 + 1)
    assert masked.total_bytes - plain.total_bytes == 3 * 2048 * 34816 * 3


def test_prefill_estimate_shape() -> None:
    g = geometry_from_config(LLAMA3_8B)
    cpu = estimate_prefill(g, chunk_tokens=2048, context_tokens=2048, backend="cpu")
    metal = estimate_prefill(g, chunk_tokens=2048, context_tokens=2048, backend="metal")
    scores = 32 * 2048 * 4096 * 4
    assert cpu.attention_bytes >= 2 * scores  # scores + softmax materialised
    assert metal.attention_bytes < scores / 10
    assert cpu.logits_bytes == 128256 * 4  # last token only
    assert cpu.total_bytes == (
        cpu.kv_growth_bytes + cpu.attention_bytes + cpu.activation_bytes + cpu.logits_bytes
    )
    # A 2048-token chunk grows every layer by 8 steps: at least 256 MiB of KV.
    assert cpu.kv_growth_bytes >= 2048 * 128 * KiB
    longer = estimate_prefill(g, chunk_tokens=2048, context_tokens=8192, backend="cpu")
    assert longer.total_bytes > cpu.total_bytes
    assert estimate_prefill(g, chunk_tokens=4096, context_tokens=0, batch=2).total_bytes > (
        estimate_prefill(g, chunk_tokens=4096, context_tokens=0).total_bytes
    )
    with pytest.raises(ValueError):
        estimate_prefill(g, chunk_tokens=0, context_tokens=0)
    with pytest.raises(ValueError):
        estimate_prefill(g, chunk_tokens=1, context_tokens=0, backend="tpu")
    assert metal.total_bytes < 1024 * MiB * 2


# ---- against MLX on this machine ---------------------------------------------------------

# Upper-bound looseness allowed. bench/estimate_vs_measured.py measured ratios of 1.07–1.69
# (float32) and up to 1.93 (bf16/fp16) on the Linux CPU backend; 2.5 leaves room for noise.
MAX_RATIO = 2.5

SMALL_MODELS: dict[str, dict[str, Any]] = {
    "gqa-hd32": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=1000,
    ),
    "mha-hd64": dict(
        hidden_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1376,
        vocab_size=2000,
    ),
}
CHUNKS = [(64, 0), (256, 0), (128, 256)]


@pytest.mark.parametrize("name", sorted(SMALL_MODELS))
def test_estimate_bounds_measured_mlx_peak(name: str) -> None:
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models import llama

    from bench.estimate_vs_measured import measure_chunk

    model = llama.Model(llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **SMALL_MODELS[name]))
    mx.eval(model.parameters())
    geometry = geometry_from_model(model)
    assert geometry.dtype_bytes == 4 and geometry.num_layers == SMALL_MODELS[name]["num_hidden_layers"]
    for chunk, context in CHUNKS:
        measured = measure_chunk(model, chunk=chunk, context=context)
        estimate = estimate_prefill(geometry, chunk_tokens=chunk, context_tokens=context).total_bytes
        assert measured > 0
        assert estimate >= measured, (name, chunk, context, estimate, measured)
        assert estimate <= MAX_RATIO * measured, (name, chunk, context, estimate, measured)


def test_geometry_from_model_reads_args_and_parameter_dtype() -> None:
    mx = pytest.importorskip("mlx.core")
    from mlx.nn.layers.quantized import quantize
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **SMALL_MODELS["gqa-hd32"])
    model = llama.Model(args)
    g = geometry_from_model(model)
    assert (g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim) == (4, 8, 2, 32)
    assert (g.hidden_size, g.intermediate_size, g.vocab_size, g.dtype_bytes) == (256, 688, 1000, 4)
    model.set_dtype(mx.bfloat16)
    assert geometry_from_model(model).dtype_bytes == 2
    config = {**SMALL_MODELS["gqa-hd32"], "intermediate_size": 512}  # divisible by 64
    quantized = llama.Model(llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **config))
    quantized.set_dtype(mx.bfloat16)
    quantize(quantized, group_size=64, bits=4)  # uint32 weights are skipped; scales are bf16
    assert geometry_from_model(quantized).dtype_bytes == 2
    assert geometry_from_model(model, dtype_bytes=4).dtype_bytes == 4
