"""The bare model's bound (bench/bound.py) on every cache kind the benchmark compares:
full, sliding-window, recurrent state (ArraysCache) and CacheList layers. Its decode step
copies one prefilled row to the batch's rows; each copy must decode as the row itself."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from bench import bound
from tests.engine import tiny_archs


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next", "falcon_h1"])
def test_the_bound_measures_each_cache_kind_and_its_rows_decode_as_one(name: str) -> None:
    model = tiny_archs.build(name)
    out = bound.measure(model, prompt_tokens=40, max_tokens=4, concurrency=[1, 3],
                        prefill_chunk=16, decode_steps=3)
    assert out["best_prefill_tok_s"] > 0
    assert set(out["decode_step_ms"]) == {"1", "3"}

    cache = make_prompt_cache(model)
    model(mx.arange(1, 41)[None], cache=cache)
    mx.eval([c.state for c in cache])
    one = model(mx.array([[5]]), cache=cache)  # the row alone
    cache = make_prompt_cache(model)
    model(mx.arange(1, 41)[None], cache=cache)
    for c in cache:
        bound._repeat_rows(c, 3)
    rows = model(mx.array([[5], [5], [5]]), cache=cache)
    assert rows.shape[0] == 3
    for r in range(3):
        assert mx.allclose(rows[r], one[0], atol=1e-4).item()
