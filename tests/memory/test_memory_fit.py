"""memory.weights, memory.walk and memory.fit: weight bytes from headers, and what fits under a ceiling."""

from __future__ import annotations

import json
import struct
from types import MappingProxyType
from typing import Any

import pytest
from memtest_helpers import GiB, MiB

from memory import Ceiling, ModelGeometry, Tier, geometry_from_config
from memory.fit import ModelSpec, compute_fit, wired_limit_advice
from memory.walk import (
    EngineParams,
    largest_chunk_bytes,
    reservation_bytes,
    store_bytes,
    walk_single_request,
)
from memory.weights import (
    Quantization,
    TensorInfo,
    inventory_from_tensors,
    largest_fused_group_bytes,
    parse_safetensors_header,
    quantization_from_config,
)

LLAMA3_8B: dict[str, Any] = {
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
}


def llama_tensors(config: dict[str, Any], q: Quantization | None = None) -> list[TensorInfo]:
    """The tensors of a Llama checkpoint as mlx-lm stores it: bf16, or packed uint32 words
    with bf16 scales and biases per group when quantized."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    matrices = {"model.embed_tokens": (vocab, h), "lm_head": (vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        matrices |= {
            f"{p}.self_attn.q_proj": (heads * hd, h), f"{p}.self_attn.k_proj": (kv * hd, h),
            f"{p}.self_attn.v_proj": (kv * hd, h), f"{p}.self_attn.o_proj": (h, heads * hd),
            f"{p}.mlp.gate_proj": (inter, h), f"{p}.mlp.up_proj": (inter, h),
            f"{p}.mlp.down_proj": (h, inter),
        }
    tensors = [TensorInfo("model.norm.weight", "BF16", (h,), 2 * h)]
    for i in range(config["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors.append(TensorInfo(f"model.layers.{i}.{norm}.weight", "BF16", (h,), 2 * h))
    for name, (rows, cols) in matrices.items():
        if q is None:
            tensors.append(TensorInfo(f"{name}.weight", "BF16", (rows, cols), 2 * rows * cols))
            continue
        words = cols * q.bits // 32
        groups = cols // q.group_size
        tensors += [
            TensorInfo(f"{name}.weight", "U32", (rows, words), 4 * rows * words),
            TensorInfo(f"{name}.scales", "BF16", (rows, groups), 2 * rows * groups),
            TensorInfo(f"{name}.biases", "BF16", (rows, groups), 2 * rows * groups),
        ]
    return tensors


def llama_spec(q: Quantization | None = None, config: dict[str, Any] = LLAMA3_8B) -> ModelSpec:
    return ModelSpec(
        "llama", geometry_from_config(config), inventory_from_tensors(llama_tensors(config, q), q),
        config["max_position_embeddings"], "test",
    )


def custom(hard: int) -> Ceiling:
    return Ceiling(hard, "custom", MappingProxyType({"custom": hard}), Tier.CUSTOM)


def header_bytes(entries: dict[str, Any]) -> bytes:
    raw = json.dumps(entries).encode()
    return struct.pack("<Q", len(raw)) + raw


# ---- weights ---------------------------------------------------------------------------


def test_safetensors_header_gives_each_tensor_its_byte_range() -> None:
    data = header_bytes({
        "__metadata__": {"format": "mlx"},
        "a.weight": {"dtype": "BF16", "shape": [4, 64], "data_offsets": [0, 512]},
        "a.scales": {"dtype": "F32", "shape": [4, 1], "data_offsets": [512, 528]},
    }) + b"\0" * 528
    tensors = {t.name: t for t in parse_safetensors_header(data)}
    assert set(tensors) == {"a.weight", "a.scales"}
    weight = tensors["a.weight"]
    assert (weight.nbytes, weight.shape, weight.elements) == (512, (4, 64), 256)
    assert tensors["a.scales"].dtype == "F32"


@pytest.mark.parametrize("data, match", [
    (b"\x01\x00", "shorter than"),
    (struct.pack("<Q", 100) + b"{}", "only 2 given"),
    (struct.pack("<Q", 3) + b"{x}", "not JSON"),
])
def test_malformed_safetensors_headers_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_safetensors_header(data)


@pytest.mark.parametrize("q", [None, Quantization(8), Quantization(4), Quantization(4, 32)])
def test_inventory_counts_quantized_matrices_by_their_logical_elements(q: Quantization | None) -> None:
    bf16 = inventory_from_tensors(llama_tensors(LLAMA3_8B))
    inv = inventory_from_tensors(llama_tensors(LLAMA3_8B, q), q)
    assert inv.total_bytes == sum(t.nbytes for t in llama_tensors(LLAMA3_8B, q))
    # The same matrices, whatever their storage: quantization never changes what is quantizable.
    assert inv.quantizable_elements == bf16.quantizable_elements
    assert inv.other_bytes == bf16.other_bytes  # the norms
    if q is not None:
        # Predicting a quantization reproduces the bytes mlx-lm actually stores.
        assert bf16.bytes_at(q) == inv.total_bytes
        assert inv.quantization == q


def test_llama3_8b_weight_bytes_match_the_published_checkpoints() -> None:
    bf16 = inventory_from_tensors(llama_tensors(LLAMA3_8B))
    assert bf16.total_bytes == 16_060_522_496  # 8.03 B parameters × 2 bytes
    q4 = inventory_from_tensors(llama_tensors(LLAMA3_8B, Quantization(4)), Quantization(4))
    assert 4.4e9 < q4.total_bytes < 4.6e9  # mlx-community/Meta-Llama-3-8B-Instruct-4bit: 4.52 GB


def test_the_largest_fused_group_is_one_layers_gate_and_up() -> None:
    """The loader fuses q/k/v and gate/up (engine.fusion): loading holds one group twice."""
    h, inter = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"]
    assert inventory_from_tensors(llama_tensors(LLAMA3_8B)).largest_fused_group_bytes == 2 * (2 * inter * h)
    q4 = llama_tensors(LLAMA3_8B, Quantization(4))
    gate_up = sum(t.nbytes for t in q4 if t.name.startswith(("model.layers.3.mlp.gate_proj.",
                                                              "model.layers.3.mlp.up_proj.")))
    assert largest_fused_group_bytes(q4) == gate_up  # packed words, scales and biases
    # an incomplete group (no up_proj) is not fused, so it adds nothing
    partial = [t for t in llama_tensors(LLAMA3_8B) if ".up_proj." not in t.name]
    qkv = sum(t.nbytes for t in partial if t.name.startswith("model.layers.0.self_attn.")
              and ".o_proj." not in t.name)
    assert largest_fused_group_bytes(partial) == qkv


def test_load_counts_the_fusion_transient_only_where_it_exceeds_the_reserve() -> None:
    spec = llama_spec()
    group = spec.weights.largest_fused_group_bytes
    common = dict(baseline_bytes=300 * MiB, max_tokens=512)
    # a one-token reserve in one-block segments: KV and chunk smaller than one gate/up pair
    tiny = dict(chunk_tokens=32, kv_segment_tokens=16)
    small = compute_fit(spec, custom(32 * GiB), reserve_tokens=1, params=EngineParams(**tiny), **common)
    unfused = compute_fit(spec, custom(32 * GiB), reserve_tokens=1,
                          params=EngineParams(**tiny, fuse_projections=False), **common)
    assert unfused.load.reserve_kv_bytes + unfused.load.margin_bytes < group
    assert small.load.total_bytes == 300 * MiB + spec.weight_bytes + group
    assert unfused.load.total_bytes < small.load.total_bytes
    assert "fusing one projection group" in small.load.describe()
    large = compute_fit(spec, custom(32 * GiB), reserve_tokens=8192, params=EngineParams(), **common)
    assert large.load.total_bytes == (300 * MiB + spec.weight_bytes + large.load.reserve_kv_bytes
                                      + large.load.margin_bytes)


@pytest.mark.parametrize("config, expected", [
    ({}, None),
    ({"quantization": {"group_size": 64, "bits": 4}}, Quantization(4, 64)),
    ({"quantization_config": {"bits": 8}}, Quantization(8, 64)),
    ({"quantization": {"group_size": 32, "bits": 3}}, Quantization(3, 32)),
    ({"quantization": "fp8"}, None),
])
def test_quantization_from_config(config: dict[str, Any], expected: Quantization | None) -> None:
    assert quantization_from_config(config) == expected


# ---- fit -------------------------------------------------------------------------------


@pytest.mark.parametrize("q, hard, reserve, backend, fits", [
    (None, 32 * GiB, 8192, "cpu", True),
    (None, 16 * GiB, 8192, "cpu", False),  # 15.0 GiB of weights + 1.25 GiB of KV
    (None, 16 * GiB, 2048, "metal", True),
    (None, 14 * GiB, 1, "metal", False),  # the weights alone are over
    (Quantization(4), 8 * GiB, 8192, "metal", True),  # the quantized model does fit
    (Quantization(4), 5 * GiB, 8192, "metal", False),
    (Quantization(8), 10 * GiB, 8192, "cuda", True),
    (Quantization(8), 9 * GiB, 8192, "cuda", False),  # 7.9 + 0.3 in use + 1 of KV + a chunk
])
def test_load_fits_exactly_when_the_reserve_prompt_would_be_admitted(
    q: Quantization | None, hard: int, reserve: int, backend: str, fits: bool
) -> None:
    spec = llama_spec(q)
    params = EngineParams(backend=backend)
    report = compute_fit(spec, custom(hard), baseline_bytes=300 * MiB, reserve_tokens=reserve,
                         max_tokens=512, params=params)
    assert report.fits is fits
    assert (report.load.total_bytes <= hard) is fits
    load = report.load
    assert load.weight_bytes == spec.weight_bytes
    assert load.reserve_kv_bytes == reservation_bytes(spec.geometry, [reserve])
    walk = walk_single_request(spec.geometry, prompt_tokens=reserve, max_tokens=0,
                               usage_bytes=300 * MiB + spec.weight_bytes, ceiling_bytes=hard,
                               params=params)
    assert walk.admitted is fits


@pytest.mark.parametrize("hard", [16 * GiB, 17 * GiB, 20 * GiB, 40 * GiB])
@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_longest_prompt_is_a_boundary_of_admission(hard: int, backend: str) -> None:
    spec, params = llama_spec(), EngineParams(backend=backend)
    report = compute_fit(spec, custom(hard), baseline_bytes=0, reserve_tokens=8192,
                         max_tokens=256, params=params)

    def admitted(prompt: int) -> bool:
        return walk_single_request(spec.geometry, prompt_tokens=prompt, max_tokens=256,
                                   usage_bytes=spec.weight_bytes, ceiling_bytes=hard,
                                   params=params).admitted

    longest = report.max_prompt_tokens
    assert longest > 0
    assert admitted(longest)
    if longest + 256 < spec.context_length:
        assert not admitted(longest + 1)


def test_more_memory_never_fits_less() -> None:
    spec = llama_spec()
    previous = None
    for hard in (15 * GiB, 16 * GiB, 18 * GiB, 24 * GiB, 48 * GiB, 96 * GiB):
        r = compute_fit(spec, custom(hard), baseline_bytes=0, reserve_tokens=8192, max_tokens=512,
                        params=EngineParams(backend="metal"))
        row = (r.max_prompt_tokens, *(c.requests for c in r.concurrency), r.max_reserve_tokens)
        if previous is not None:
            assert all(a >= b for a, b in zip(row, previous, strict=True)), (hard, row, previous)
        previous = row
    assert previous is not None and previous[1] > 32  # 96 GiB holds many 1k-token requests


def test_refusal_names_the_numbers_the_binding_ceiling_and_what_would_fit() -> None:
    spec, params = llama_spec(), EngineParams(backend="metal")
    r = compute_fit(spec, custom(16 * GiB), baseline_bytes=0, reserve_tokens=65536,
                    max_tokens=512, params=params)
    assert not r.fits and r.fits_at_all
    message = r.message()
    assert "does not fit" in message and "custom ceiling 16.0 GiB" in message
    assert "weights 15.0 GiB" in message and "KV for 65536 reserved tokens" in message
    assert f"--reserve-context-tokens {r.max_reserve_tokens}" in message
    # 8-bit weights (7.9 GiB) would still be over with 64k tokens (8 GiB) of KV; 4-bit fits
    assert [(q.quantization.bits, q.fits) for q in r.quantized] == [(8, False), (4, True)]
    assert "4-bit (group 64) weights (4.2 GiB)" in message and "--force-load" in message
    assert 0 < r.max_reserve_tokens < 65536 and r.max_reserve_tokens % 256 == 0
    shorter = compute_fit(spec, custom(16 * GiB), baseline_bytes=0,
                          reserve_tokens=r.max_reserve_tokens, max_tokens=512, params=params)
    assert shorter.fits  # the suggested reserve does load
    assert r.shortfall_bytes == r.load.total_bytes - 16 * GiB


def test_a_model_larger_than_the_ceiling_fits_nothing() -> None:
    r = compute_fit(llama_spec(), custom(8 * GiB), baseline_bytes=0, reserve_tokens=8192,
                    max_tokens=512, params=EngineParams())
    assert not r.fits and not r.fits_at_all
    assert r.max_prompt_tokens == 0 and r.max_reserve_tokens == 0
    assert all(c.requests == 0 for c in r.concurrency)
    assert [q.quantization.bits for q in r.quantized if q.fits] == [4]  # 4-bit would load


def test_concurrency_counts_reservations_and_flags_prompts_beyond_the_context() -> None:
    config = {**LLAMA3_8B, "max_position_embeddings": 8192}
    spec = llama_spec(config=config)
    params = EngineParams(backend="metal", kv_segment_tokens=16384)  # 2 GiB segments
    r = compute_fit(spec, custom(40 * GiB), baseline_bytes=0, reserve_tokens=8192,
                    max_tokens=512, params=params)
    by_prompt = {c.prompt_tokens: c for c in r.concurrency}
    assert by_prompt[8192].beyond_context and by_prompt[32768].beyond_context
    n = by_prompt[1024].requests
    assert n > 1
    room = 40 * GiB - spec.weight_bytes
    chunk = largest_chunk_bytes(spec.geometry, 1024, params)

    def need(rows: int) -> int:  # the segments holding them + one full-size chunk
        return store_bytes(spec.geometry, 1536, rows, params) + chunk

    assert need(n) <= room < need(n + 1)
    # 1536 tokens of 128 KiB = 192 MiB each, 10 to a 2 GiB segment: 12 segments (120) and
    # a few more in the last 1 GiB beside a prefill chunk
    assert 120 < n <= 125


@pytest.mark.parametrize("components, binding, needed, macos, expected", [
    ({"static": 58 * GiB, "dynamic": 60 * GiB, "device": 48 * GiB}, "device", 50 * GiB, True, 58 * 1024),
    # the static limit, not this minute's dynamic one: the setting persists
    ({"static": 58 * GiB, "dynamic": 52 * GiB, "device": 48 * GiB}, "device", 0, True, 58 * 1024),
    ({"static": 58 * GiB, "dynamic": 52 * GiB, "device": 48 * GiB}, "device", 53 * GiB, True, None),
    ({"custom": 60 * GiB, "device": 48 * GiB}, "device", 0, True, 60 * 1024),
    ({"static": 58 * GiB, "dynamic": 60 * GiB, "device": 48 * GiB}, "device", 59 * GiB, True, None),
    ({"static": 58 * GiB, "dynamic": 60 * GiB, "device": 48 * GiB}, "device", 0, False, None),
    ({"static": 40 * GiB, "dynamic": 60 * GiB, "device": 48 * GiB}, "static", 0, True, None),
])
def test_wired_limit_advice(
    components: dict[str, int], binding: str, needed: int, macos: bool, expected: int | None
) -> None:
    ceiling = Ceiling(components[binding], binding, MappingProxyType(components), Tier.BALANCED)
    assert wired_limit_advice(ceiling, needed, macos=macos) == expected


def test_a_binding_wired_limit_is_suggested_when_raising_it_makes_the_model_fit() -> None:
    components = {"static": 58 * GiB, "dynamic": 60 * GiB, "device": 16 * GiB}
    ceiling = Ceiling(16 * GiB, "device", MappingProxyType(components), Tier.BALANCED)
    r = compute_fit(llama_spec(), ceiling, baseline_bytes=0, reserve_tokens=8192, max_tokens=512,
                    params=EngineParams(backend="metal"), macos=True)
    assert not r.fits and r.wired_limit_mb == 58 * 1024
    assert "sudo sysctl iogpu.wired_limit_mb=59392" in r.message()
    assert "device ceiling 16.0 GiB" in r.message()


@pytest.mark.parametrize("finals, blocks", [
    ([], 0), ([1], 1), ([16], 1), ([17], 2), ([300], 19), ([300, 100], 19 + 7),
])
def test_each_request_reserves_its_own_whole_blocks(finals: list[int], blocks: int) -> None:
    g = ModelGeometry(4, 4, 2, 32, 128, 256, 259, dtype_bytes=4)
    assert reservation_bytes(g, finals) == blocks * 16 * g.kv_bytes_per_token


@pytest.mark.parametrize("n, segments_tokens", [
    (1, 304), (3, 912), (6, 2048), (7, 2048 + 304), (12, 2 * 2048), (13, 2 * 2048 + 304),
])
def test_store_bytes_packs_requests_into_default_segments(n: int, segments_tokens: int) -> None:
    # 300-token requests reserve 304 tokens; a 2048-token segment holds 6 of them. The
    # requests left over cost a default segment or their own, whichever is smaller: the
    # engine takes a default one only when it fits.
    g = ModelGeometry(4, 4, 2, 32, 128, 256, 259, dtype_bytes=4)
    params = EngineParams(kv_segment_tokens=2048)
    assert store_bytes(g, 300, n, params) == segments_tokens * g.kv_bytes_per_token


def test_no_sysctl_when_raising_the_wired_limit_would_not_be_enough() -> None:
    components = {"static": 14 * GiB, "dynamic": 30 * GiB, "device": 12 * GiB}
    ceiling = Ceiling(12 * GiB, "device", MappingProxyType(components), Tier.BALANCED)
    r = compute_fit(llama_spec(), ceiling, baseline_bytes=0, reserve_tokens=8192, max_tokens=512,
                    params=EngineParams(backend="metal"), macos=True)
    assert not r.fits and r.wired_limit_mb is None  # 15 GiB of weights: over even 14 GiB
    assert "sysctl" not in r.message() and "8-bit (group 64) weights (7.9 GiB)" in r.message()
