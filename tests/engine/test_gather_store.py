"""MLA in the paged store: caches of other shapes than the config's heads (a latent key and a
rotary value, one head), held in blocks, each decode row's K/V gathered for the model's own
attention (`KVGeometry.gather`). Rows in several segments, of unequal lengths, decode
together with output identical to mlx-lm's; the store counts what the caches hold."""

from __future__ import annotations

import random
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine import EngineRequest, LoadedModel, SamplingParams
from engine.cache_layout import geometry_for, probe_cache_layout
from engine.kv import KVStore
from tests.engine import tiny_archs
from tests.engine.conftest import Harness


def _loaded(model_type: str) -> LoadedModel:
    model = tiny_archs.build(model_type)
    layout = probe_cache_layout(model, weights_loaded=True)
    return LoadedModel(model=model, tokenizer=None, model_id=model_type, path="",
                       geometry=geometry_for(model, layout), backend="cpu",
                       context_length=4096, weight_bytes=0, layout=layout)


def test_mla_rows_in_several_segments_decode_together_as_mlx_lm_does(
    make_engine: Callable[..., Harness],
) -> None:
    loaded = _loaded("deepseek_v3")
    h = make_engine(loaded=loaded, prefill_step_size=16, prefix_cache_bytes=0, kv_segment_tokens=64)
    store = h.core.store
    assert isinstance(store, KVStore) and store.geometry.gather
    g = store.geometry
    assert (g.num_kv_heads, g.head_dim, g.value_dim) == (1, 8, 16)  # the latent, then the rotary part
    assert g.model_bytes_per_token == loaded.geometry.kv_bytes_per_token  # what load admission counts
    rng = random.Random(2)
    shapes = [(40, 9), (3, 12), (70, 6), (17, 10)]
    prompts = [tuple(rng.randrange(200) for _ in range(n)) for n, _ in shapes]
    for i, (p, (_, n)) in enumerate(zip(prompts, shapes, strict=True)):
        h.submit(EngineRequest(f"r{i}", p, n, SamplingParams(temperature=0.0)))
    segments = 0
    while len(h.out.finished) < len(prompts):
        h.step()
        if len(h.core.batch) >= 3:
            segments = max(segments, len({store.get(s.request_id).segment.id for s in h.core.batch.seqs}))
    assert segments >= 3  # rows decoded from several segments, put back in batch order
    for i, (p, (_, n)) in enumerate(zip(prompts, shapes, strict=True)):
        steps = generate_step(mx.array(p), loaded.model, max_tokens=n, prefill_step_size=16)
        assert h.out.tokens[f"r{i}"] == [int(t) for t, _ in steps], i


def test_mla_refuses_quantized_kv_with_the_widths(make_engine: Callable[..., Harness]) -> None:
    import pytest

    with pytest.raises(ValueError, match="keys of 8 and values of 16"):
        make_engine(loaded=_loaded("deepseek_v3"), kv_bits=8, kv_group_size=32)
