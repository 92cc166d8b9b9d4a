"""Quantized mixture-of-experts models: the experts' `gather_qmm` sees its input as rows
(engine.quantized), and that changes no token: greedy output equals mlx-lm's own
generation on the same quantized weights, alone and batched, affine and mxfp4 (as gpt-oss
ships: experts in mxfp4, the rest affine 8-bit)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear, SwitchMLP

from engine import EngineRequest, LoadedModel, SamplingParams
from engine.cache_layout import geometry_for, probe_cache_layout
from engine.quantized import FlatQuantizedSwitchLinear, flatten_quantized
from tests.engine import tiny_archs
from tests.engine.conftest import Harness

PROMPTS = [(40, 8), (5, 12), (23, 9)]  # (prompt tokens, new tokens): 40 × 2 experts sorts


def _quantize(model: nn.Module, scheme: str) -> None:
    if scheme == "affine4":
        nn.quantize(model, group_size=32, bits=4)
    else:  # "mxfp4": experts in mxfp4 (group 32, no biases), everything else affine 8-bit
        nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                    class_predicate=lambda _, m: isinstance(m, SwitchLinear))
        nn.quantize(model, group_size=32, bits=8)
    mx.eval(model.parameters())


def _model(arch: str, scheme: str) -> Any:
    model = tiny_archs.build(arch)
    _quantize(model, scheme)
    return model


def _loaded(model: Any, name: str) -> LoadedModel:
    layout = probe_cache_layout(model, weights_loaded=True)
    return LoadedModel(model=model, tokenizer=None, model_id=name, path="",
                       geometry=geometry_for(model, layout), backend="cpu",
                       context_length=4096, weight_bytes=0, layout=layout)


def _prompt(i: int, n: int) -> tuple[int, ...]:
    rng = random.Random(700 + i)
    return tuple(rng.randrange(0, tiny_archs.VOCAB) for _ in range(n))


def _mlx_lm_greedy(model: Any, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                          sampler=lambda logits: mx.argmax(logits, axis=-1))
    return [int(token) for token, _ in steps]


CASES = [("qwen3_moe", "affine4"), ("gpt_oss", "mxfp4"), ("mixtral", "mxfp4")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def case(request: pytest.FixtureRequest) -> tuple[LoadedModel, dict[str, list[int]]]:
    arch, scheme = request.param
    reference = _model(arch, scheme)  # mlx-lm's own classes, untouched
    expected = {f"q{i}": _mlx_lm_greedy(reference, _prompt(i, n), m)
                for i, (n, m) in enumerate(PROMPTS)}
    served = _model(arch, scheme)  # the same weights (fixed seed), flattened
    flat = flatten_quantized(served)
    experts = sum(isinstance(m, FlatQuantizedSwitchLinear) for _, m in served.named_modules())
    assert flat > experts > 0
    return _loaded(served, f"{arch}-{scheme}"), expected


def test_greedy_output_is_mlx_lms_alone_and_batched(case, make_engine: Callable[..., Harness]):
    loaded, expected = case
    for i, (n, m) in enumerate(PROMPTS):
        h = make_engine(loaded=loaded, prefix_cache_bytes=0)
        h.submit(EngineRequest(f"q{i}", _prompt(i, n), m, SamplingParams(temperature=0.0)))
        h.run_until(lambda i=i, h=h: f"q{i}" in h.out.finished)
        assert h.out.tokens[f"q{i}"] == expected[f"q{i}"], "alone"
    h = make_engine(loaded=loaded, prefix_cache_bytes=0)
    for i, (n, m) in enumerate(PROMPTS):
        h.submit(EngineRequest(f"q{i}", _prompt(i, n), m, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.out.finished) == len(PROMPTS))
    assert h.core.stats.max_batch == len(PROMPTS)
    assert h.out.tokens == expected, "batched"


@pytest.mark.parametrize("sequences", [3, 32])
def test_a_decode_steps_quantized_products_see_rows(case, sequences: int,
                                                     make_engine: Callable[..., Harness],
                                                     monkeypatch: pytest.MonkeyPatch):
    """quantized_matmul gets (rows, K); gather_qmm gets (rows, 1, K) and one expert index per
    row, not SwitchGLU's (B, 1, 1, 1, K) against (B, 1, k): 3 sequences route 6 rows
    (unsorted), 32 route 64 (mlx-lm sorts them by expert)."""
    loaded, _ = case
    matmuls: list[int] = []
    gathers: list[tuple[int, int, bool]] = []
    quantized_matmul, gather_qmm = mx.quantized_matmul, mx.gather_qmm

    def spy_matmul(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        matmuls.append(x.ndim)
        return quantized_matmul(x, *args, **kwargs)

    def spy_gather(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        gathers.append((x.ndim, kwargs["rhs_indices"].ndim, kwargs["sorted_indices"]))
        return gather_qmm(x, *args, **kwargs)

    h = make_engine(loaded=loaded, prefix_cache_bytes=0)
    for i in range(sequences):
        h.submit(EngineRequest(f"d{i}", _prompt(i, 7 + i % 5), 4, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.core.batch.seqs) == sequences)
    monkeypatch.setattr(mx, "quantized_matmul", spy_matmul)
    monkeypatch.setattr(mx, "gather_qmm", spy_gather)
    h.step()  # a decode step of every sequence
    monkeypatch.undo()
    assert matmuls and gathers, "the quantized model ran no quantized product"
    assert set(matmuls) == {2}, matmuls
    assert set(gathers) == {(3, 1, sequences * 2 >= 64)}, gathers


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
@pytest.mark.parametrize("kind", [SwitchGLU, SwitchMLP])
def test_the_flat_experts_give_the_same_numbers_sorted_or_not(kind: type, mode: str):
    """Bit for bit, with expert biases, for decode batches under and over SwitchGLU's
    64-row sorting threshold and for a prefill."""
    mx.random.seed(3)
    block = kind(64, 64, 8, bias=True)
    nn.quantize(block, group_size=32, bits=4, mode=mode)
    mx.eval(block.parameters())
    cases = []
    for shape in ((1, 1), (5, 1), (48, 1), (1, 40)):  # (sequences, tokens) × 2 experts each
        x = mx.random.normal((*shape, 64))
        indices = mx.random.randint(0, 8, (*shape, 2)).astype(mx.uint32)
        cases.append((x, indices, block(x, indices)))
    assert flatten_quantized(block) == (3 if kind is SwitchGLU else 2)
    for x, indices, expected in cases:
        got = block(x, indices)
        assert got.shape == expected.shape
        assert mx.array_equal(got, expected).item(), (x.shape, indices.shape)
