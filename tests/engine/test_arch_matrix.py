"""Every model type the installed mlx-lm ships, served with greedy output token-identical to
mlx-lm's own `generate_step` on the same weights.

For each type a tiny random float32 model (tests/engine/tiny_archs.py) is built once and
served by one engine: one request alone, then four prompts of mixed lengths at once, then
the first prompt again, a prefix-cache hit: blocks on the paged store, a snapshot of
mlx-lm's own caches on the dense path (engine.dense.prefix). Every answer equals mlx-lm's.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx_lm.models
import pytest
from mlx_lm.generate import generate_step

from engine import EngineRequest, LoadedModel, SamplingParams
from engine.cache_layout import geometry_for, probe_cache_layout
from tests.engine import tiny_archs
from tests.engine.conftest import Harness

STEP = 16  # prefill chunk: the longer prompts run in several chunks, past the 16-token windows
FIRST = (40, 8)  # (prompt tokens, new tokens)
TOGETHER = [(29, 8), (3, 10), (17, 5), (1, 7)]

# Types that cannot run on a Linux CPU, with the reason.
EXPECTED_FAIL: dict[str, str] = {
    "bitnet": "its BitLinear layers run a Metal kernel (mx.fast.metal_kernel)",
    "muse_spark": "its norms, rotary and expert routing run Metal kernels (mlx_lm.kernels)",
}

# Types with sliding-window layers that the paged store holds in layer groups, window layers
# as rings (memory.paged; docs/cache-kinds.md lists every type's path).
PAGED_WINDOWS = {
    "afmoe", "cohere2", "exaone4", "exaone_moe", "gemma3", "gemma3_text", "gemma3n", "gpt_oss", "laguna",
    "llama", "mellum", "mimo_v2_flash", "ministral3", "muse_glimmer", "olmo3", "plamo3",
    "spark2_5", "step3p5",
}

# Types whose caches are not the config's heads (MLA's latent keys and rotary values), or
# whose attention computes its scores itself (Gemma 2's soft-capping): held in the paged
# store, each decode row's K/V gathered for the model's own attention.
PAGED_GATHER = {
    "deepseek_v2", "deepseek_v3", "gemma2", "glm4_moe_lite", "kimi_k25", "kimi_vl", "mistral4", "plamo",
}

# Hybrids: attention layers in the paged store (MLA ones through the gather path), their
# recurrent state beside it (engine.kv.state).
PAGED_STATES = {
    "bailing_hybrid", "bailing_moe_linear", "bailing_moe_v3", "granitemoehybrid", "jamba", "kimi_k3",
    "kimi_linear", "lfm2", "lfm2-vl", "lfm2_moe", "nemotron_h", "olmo_hybrid", "prism_hadamard_qwen35",
    "qwen3_5", "qwen3_5_moe", "qwen3_next",
}

# Types whose mlx-lm forward fails on its own (nothing to compare against): the test checks
# that generate_step still fails, so that a fixed mlx-lm puts the type back in the matrix.
MLX_LM_FAILS: dict[str, str] = {
    "olmo": "its attention adds the 'causal' mask string to its scores on any prompt of two "
            "or more tokens",
}


def model_types() -> list[str]:
    """The installed mlx-lm's model types: each module of `mlx_lm/models/` that defines or
    imports both `Model` and `ModelArgs` at its top level (read from the source, nothing
    imported: olmo's module exits without ai2-olmo)."""
    def has(name: str, source: str) -> bool:
        return re.search(rf"^(class {name}\b|from \S+ import .*\b{name}\b)", source, re.M) is not None

    return [
        path.stem for path in sorted(Path(mlx_lm.models.__path__[0]).glob("*.py"))
        if has("Model", source := path.read_text()) and has("ModelArgs", source)
    ]


def test_every_model_type_of_the_installed_mlx_lm_has_a_config() -> None:
    missing = sorted(set(model_types()) - set(tiny_archs.CONFIGS))
    assert not missing, f"model types without a tiny config in tests/engine/tiny_archs.py: {missing}"
    assert not set(tiny_archs.CONFIGS) - set(model_types()), "configs of types mlx-lm does not ship"
    assert set(EXPECTED_FAIL) | set(MLX_LM_FAILS) <= set(tiny_archs.CONFIGS)


def _reference(model: object, prompt: list[int], max_tokens: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=STEP)
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("model_type", [
    pytest.param(name, marks=pytest.mark.xfail(reason=EXPECTED_FAIL[name], raises=RuntimeError, strict=True))
    if name in EXPECTED_FAIL else name
    for name in sorted(tiny_archs.CONFIGS, key=str.lower)
])
def test_greedy_output_equals_mlx_lm(model_type: str, make_engine: Callable[..., Harness]) -> None:
    model = tiny_archs.build(model_type)
    if model_type in MLX_LM_FAILS:
        with pytest.raises(ValueError):
            _reference(model, list(range(1, 1 + FIRST[0])), FIRST[1])
        return
    layout = probe_cache_layout(model, weights_loaded=True)
    loaded = LoadedModel(model=model, tokenizer=None, model_id=model_type, path="",
                         geometry=geometry_for(model, layout), backend="cpu",
                         context_length=4096, weight_bytes=0, layout=layout)
    rng = random.Random(model_type)
    vocab = min(layout.vocab_size, tiny_archs.VOCAB)
    shapes = [FIRST, *TOGETHER]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n, _ in shapes]
    expected = [_reference(model, p, n) for p, (_, n) in zip(prompts, shapes, strict=True)]
    requests = [
        EngineRequest(f"r{i}", tuple(p), n, SamplingParams(temperature=0.0))
        for i, (p, (_, n)) in enumerate(zip(prompts, shapes, strict=True))
    ]
    h = make_engine(loaded=loaded, prefill_step_size=STEP, prefix_cache_bytes=1 << 24)
    geometry = getattr(h.core.store, "geometry", None)
    assert bool(getattr(geometry, "windowed", False)) == (model_type in PAGED_WINDOWS), "docs/cache-kinds.md"
    assert bool(getattr(geometry, "states", ())) == (model_type in PAGED_STATES), "docs/cache-kinds.md"
    hybrid_mla = {"bailing_hybrid", "bailing_moe_v3", "kimi_k3", "kimi_linear"}
    assert bool(getattr(geometry, "gather", False)) == (model_type in PAGED_GATHER | hybrid_mla), \
        "docs/cache-kinds.md"

    def run(batch: list[EngineRequest]) -> list[list[int]]:
        for r in batch:
            h.submit(r)
        h.run_until(lambda: all(r.request_id in h.out.finished for r in batch), max_steps=500)
        return [h.out.tokens[r.request_id] for r in batch]

    assert run(requests[:1]) == expected[:1], "alone"
    counters = h.core._counters
    calls, chunks = counters["prefill_calls"], counters["prefill_chunks"]
    assert run(requests[1:]) == expected[1:], "four at once"
    if getattr(h.core.store, "batches_prefill", True):  # the paged store, and the dense path's batches
        assert counters["prefill_calls"] - calls < counters["prefill_chunks"] - chunks, "prompts shared calls"
    assert h.core.batch.max_batch_seen >= 3
    assert run([dataclasses.replace(requests[0], request_id="again")]) == expected[:1], "again"
    assert h.out.cached["again"] > 0, "the repeat is a prefix-cache hit"
    assert h.core.store.requests == {}
