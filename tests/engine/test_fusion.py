"""Fused projections (`engine.fusion`): one matmul for q/k/v and one for gate/up, with the
model's own results.

Real engines on the tiny float32 model, loaded twice (fused, the default, and unfused),
serving the same requests; and the fusion's edges on the bare model: quantized groups,
mixed groups left alone, a later projection called out of turn.
"""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from engine import EngineRequest, SamplingParams, load_model
from engine.fusion import FusedLead, FusedPart, fuse_projections

SHAPES = [(13, 40), (300, 25), (45, 50), (128, 20), (7, 33)]


def _serve(make_engine, loaded):
    h = make_engine(loaded=loaded, prefill_step_size=64, max_concurrency=4, prefix_cache_bytes=0)
    requests = []
    for i, (n_prompt, max_tokens) in enumerate(SHAPES):
        rng = random.Random(700 + i)
        requests.append(EngineRequest(f"f{i}", tuple(rng.randrange(0, 256) for _ in range(n_prompt)),
                                      max_tokens, SamplingParams(temperature=0.0, logprobs=True)))
        h.submit(requests[-1])
    h.run_until(lambda: h.out.finished.keys() >= {r.request_id for r in requests})
    return h.out


def test_a_fused_model_serves_the_unfused_models_tokens_and_logprobs(tiny_model_path: Path,
                                                                      make_engine) -> None:
    separate = load_model(str(tiny_model_path), fuse_projections=False)
    fused = load_model(str(tiny_model_path))
    layers = separate.geometry.num_layers
    assert (separate.fused_groups, fused.fused_groups) == (0, 2 * layers)
    attn = fused.model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedLead) and isinstance(attn.v_proj, FusedPart)

    # prompts in chunks, batched decode, joins and leaves
    a, b = _serve(make_engine, separate), _serve(make_engine, fused)
    for i, (_, max_tokens) in enumerate(SHAPES):
        rid = f"f{i}"
        assert len(a.tokens[rid]) == max_tokens
        assert b.tokens[rid] == a.tokens[rid], rid
        assert b.logprobs[rid] == pytest.approx(a.logprobs[rid], abs=1e-4), rid


def _tiny(tiny_model_path: Path):
    return load_model(str(tiny_model_path), fuse_projections=False).model


def test_fusion_keeps_the_weight_bytes_and_counts_each_array_once(tiny_model_path: Path) -> None:
    model = _tiny(tiny_model_path)
    before = tree_flatten(model.parameters())
    report = fuse_projections(model)
    after = tree_flatten(model.parameters())
    layers = len(model.model.layers)
    assert (report.groups, report.skipped) == (2 * layers, 0)
    assert sum(v.nbytes for _, v in after) == sum(v.nbytes for _, v in before)
    assert len(after) == len(before) - 3 * layers  # five projection weights became two
    assert fuse_projections(model).groups == 0  # a fused model has nothing left to fuse


def test_a_quantized_model_fuses_to_the_same_logits(tiny_model_path: Path) -> None:
    separate, fused = _tiny(tiny_model_path), _tiny(tiny_model_path)
    for m in (separate, fused):
        nn.quantize(m, group_size=32, bits=4)
    assert fuse_projections(fused).groups == 2 * len(fused.model.layers)
    assert isinstance(fused.model.layers[0].mlp.gate_proj.fused, nn.QuantizedLinear)
    x = mx.array([[5, 17, 99, 3, 250, 42, 7]])
    assert mx.abs(fused(x) - separate(x)).max().item() < 1e-5


def test_groups_of_mixed_kinds_are_left_alone(tiny_model_path: Path) -> None:
    model = _tiny(tiny_model_path)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda path, m: path.endswith("q_proj"))
    report = fuse_projections(model)
    layers = len(model.model.layers)
    assert (report.groups, report.skipped) == (layers, layers)  # the MLPs only
    assert type(model.model.layers[0].self_attn.k_proj) is nn.Linear


def test_a_later_projection_called_out_of_turn_computes_its_own_rows(tiny_model_path: Path) -> None:
    reference, model = _tiny(tiny_model_path), _tiny(tiny_model_path)
    fuse_projections(model)
    ref, attn = reference.model.layers[1].self_attn, model.model.layers[1].self_attn
    x = mx.random.normal((2, 3, ref.q_proj.weight.shape[1]))
    y = mx.random.normal(x.shape)

    def same(a: mx.array, b: mx.array) -> bool:
        # float32 rounding: one 256-wide matmul and a 64-wide one sum in different orders
        # under OpenBLAS (CI preloads it); a wrong row or input would be off by O(1)
        return mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()

    assert same(attn.k_proj(x), ref.k_proj(x))  # before the lead: no outputs kept yet
    attn.q_proj(x)
    assert same(attn.v_proj(y), ref.v_proj(y))  # another input than the lead's
    assert same(attn.k_proj(x), ref.k_proj(x))  # the lead's input: its kept rows
    assert same(attn.v_proj(x), ref.v_proj(x))


def test_fusing_leaves_no_more_than_one_groups_originals_in_mlxs_cache(tiny_model_path: Path) -> None:
    """MLX keeps freed buffers in its cache, which the device counts (on CUDA up to most of
    the card): fusing must not leave every original projection there beside its fusion."""
    model = _tiny(tiny_model_path)
    group = max(sum(p.nbytes for _, p in tree_flatten(layer.mlp.gate_proj.parameters()))
                + sum(p.nbytes for _, p in tree_flatten(layer.mlp.up_proj.parameters()))
                for layer in model.model.layers)
    freed = sum(v.nbytes for k, v in tree_flatten(model.parameters())
                if any(f".{n}." in k for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")))
    assert freed > 4 * group  # several groups' worth is freed in all
    previous = mx.set_cache_limit(1 << 30)  # as roomy as on CUDA or Metal
    try:
        mx.clear_cache()
        fuse_projections(model)
        assert mx.get_cache_memory() <= group
    finally:
        mx.set_cache_limit(previous)
