"""Models whose caches the paged store cannot hold are served through mlx-lm's own caches,
with output token-identical to mlx-lm's `generate_step` on the same weights: one request,
then four prompts of mixed lengths at once (rows join and leave the merged batch).

Tiny random float32 models of each cache kind (tests/engine/tiny_archs.py): sliding
window, sinks, recurrent state, MLA, `CacheList`, chunked attention (no `merge`: rows step
one at a time). And the window's memory: a long request on a sliding-window model holds
window-sized KV on its sliding layers, as the store counts it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from engine import EngineRequest, RequestOutput, SamplingParams, TokenLogprob
from engine.cache_layout import geometry_for, probe_cache_layout
from engine.dense import DenseStore
from engine.kv import KVStore
from engine.model_spec import read_model_spec
from tests.engine import tiny_archs
from tests.engine.conftest import Harness

STEP = 32  # prefill chunk: prompts longer than it run in several chunks
SHAPES = [(37, 20), (5, 25), (90, 12), (1, 18)]  # (prompt tokens, new tokens)


def _prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(tiny_archs.VOCAB) for _ in range(n)] for n, _ in SHAPES]


def _reference(model: object, prompt: list[int], max_tokens: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=STEP)
    return [int(token) for token, _ in steps]


def _run(h: Harness, requests: list[EngineRequest]) -> None:
    for r in requests:
        h.submit(r)
    h.run_until(lambda: all(r.request_id in h.out.finished for r in requests))


@pytest.mark.parametrize(
    "name", ["gemma3_text", "gpt_oss", "qwen3_next", "mamba2", "deepseek_v3", "falcon_h1", "llama4"]
)
def test_greedy_output_equals_mlx_lm_alone_and_batched(
    name: str, make_engine: Callable[..., Harness]
) -> None:
    loaded = tiny_archs.loaded(name)
    prompts = _prompts()
    expected = [_reference(loaded.model, p, n) for p, (_, n) in zip(prompts, SHAPES, strict=True)]
    requests = [
        EngineRequest(f"r{i}", tuple(p), n, SamplingParams(temperature=0.0))
        for i, (p, (_, n)) in enumerate(zip(prompts, SHAPES, strict=True))
    ]

    alone = make_engine(loaded=loaded, paged_windows=False, paged_gather=False, paged_states=False,
                        prefill_step_size=STEP, prefix_cache_bytes=0)
    assert isinstance(alone.core.store, DenseStore)
    _run(alone, requests[:1])
    assert alone.out.tokens["r0"] == expected[0]

    together = make_engine(loaded=loaded, paged_windows=False, paged_gather=False, paged_states=False,
                           prefill_step_size=STEP, prefix_cache_bytes=0)
    _run(together, requests)
    assert [together.out.tokens[r.request_id] for r in requests] == expected
    assert together.core.batch.max_batch_seen >= 3
    assert together.core.store.requests == {} and together.core.store.request_bytes() == 0


def test_a_model_without_the_usual_config_keys_is_sized_from_its_caches(
    make_engine: Callable[..., Harness],
) -> None:
    """gpt2's config names its heads n_head: the probe sizes it, and the paged store serves it."""
    loaded = tiny_archs.loaded("gpt2")
    assert loaded.geometry.num_kv_heads == 4 and loaded.geometry.head_dim == 16
    h = make_engine(loaded=loaded, prefill_step_size=STEP, prefix_cache_bytes=0)
    assert isinstance(h.core.store, KVStore)
    prompt = _prompts()[2]
    _run(h, [EngineRequest("g", tuple(prompt), 10, SamplingParams(temperature=0.0))])
    assert h.out.tokens["g"] == _reference(loaded.model, prompt, 10)


def test_mla_is_counted_at_its_latent_size() -> None:
    """deepseek_v3 stores one latent head: keys kv_lora_rank wide, values qk_rope_head_dim."""
    model = tiny_archs.build("deepseek_v3", evaluate=False)  # lazy: nothing is allocated
    layout = probe_cache_layout(model)
    config = tiny_archs.CONFIGS["deepseek_v3"]
    assert [(c.kv_heads, c.key_dim, c.value_dim) for c in layout.layers] == [
        (1, config["kv_lora_rank"], config["qk_rope_head_dim"])
    ] * config["num_hidden_layers"]
    per_token = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4 * config["num_hidden_layers"]
    assert layout.bytes_per_token == per_token
    assert geometry_for(model, layout).kv_bytes_per_token == per_token
    assert not layout.plain_kv


def test_a_long_request_holds_window_sized_kv_on_sliding_layers(
    make_engine: Callable[..., Harness],
) -> None:
    loaded = tiny_archs.loaded("gemma3_text")
    layout = loaded.cache_layout()
    window = tiny_archs.CONFIGS["gemma3_text"]["sliding_window"]
    kinds = layout.kinds()
    assert kinds == {"window": 2, "full": 2}
    per_layer = layout.layers[0].bytes_per_token
    prompt_tokens, new_tokens = 300, 8
    h = make_engine(loaded=loaded, paged_windows=False, prefill_step_size=STEP, prefix_cache_bytes=0)
    store = h.core.store
    assert isinstance(store, DenseStore)
    # reserved: full layers every token (and up to one 256-token step more: a row merged
    # into the decode batch grows from its exact length), window layers the window + a chunk
    total = prompt_tokens + new_tokens
    assert store.reservation_bytes(total) == (
        2 * (total + 255) * per_layer + 2 * (window + STEP - 1) * per_layer
    )
    assert store.reservation_bytes(total) < 4 * 512 * per_layer

    prompt = tuple(random.Random(3).randrange(tiny_archs.VOCAB) for _ in range(prompt_tokens))
    h.submit(EngineRequest("long", prompt, new_tokens, SamplingParams(temperature=0.0)))
    peak_window = decode_steps = 0
    while "long" not in h.out.finished:
        h.step()
        held = store.kind_bytes()
        peak_window = max(peak_window, held.get("window", 0))
        if len(h.core.batch):  # decoding: the window layers hold the window, no more
            decode_steps += 1
            assert held["window"] <= 2 * window * per_layer
            assert held["full"] >= 2 * prompt_tokens * per_layer
            assert h.core.stats.kv_bytes == store.request_bytes()
    assert decode_steps >= new_tokens - 1
    assert peak_window <= 2 * (window + STEP - 1) * per_layer
    assert h.out.tokens["long"] == _reference(loaded.model, list(prompt), new_tokens)


def test_prompt_logprobs_on_the_dense_path_equal_mlx_lms_forward(
    make_engine: Callable[..., Harness],
) -> None:
    loaded = tiny_archs.loaded("gemma3_text")  # 70 tokens: past the 16-token window, in three chunks
    prompt = tuple(_prompts(seed=4)[2][:70])
    logits = loaded.model(mx.array(prompt)[None])[0]
    reference = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    h = make_engine(loaded=loaded, paged_windows=False, prefill_step_size=STEP, prefix_cache_bytes=0)
    scores: list[object] = []
    publish = h.core.publish

    def keep(outputs: list[RequestOutput]) -> None:
        scores.extend(s for o in outputs for s in o.prompt_logprobs)
        publish(outputs)

    h.core.publish = keep
    h.submit(EngineRequest("s", prompt, 0, SamplingParams(temperature=0.0), prompt_logprobs=2))
    h.run_until(lambda: "s" in h.out.finished)
    assert len(scores) == len(prompt) and scores[0] is None
    for j in range(1, len(prompt)):
        entry = scores[j]
        assert isinstance(entry, TokenLogprob) and entry.token == prompt[j]
        assert entry.logprob == pytest.approx(float(reference[j - 1, prompt[j]]), abs=1e-4)
    assert h.core.store.requests == {}


@pytest.mark.parametrize("name", ["gpt2", "mamba2", "deepseek_v3", "dbrx", "prism_hadamard_qwen35"])
def test_load_admission_sizes_a_model_from_its_caches_before_loading(name: str, tmp_path: Path) -> None:
    """Configs without the usual keys (gpt2's n_head, mamba2's state) and MLA are sized
    from a lazy probe of the model their config builds, as the loaded model will be.
    prism_hadamard_qwen35 reads values on the host only in `sanitize`, never in its forward,
    so it is probed too: half its layers hold gated delta-net state, not KV.
    dbrx's router does read them in its forward: it is sized from its config's own names
    (d_model, n_heads, attn_config.kv_n_heads), every layer full attention as it is."""
    model = tiny_archs.build(name)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(tiny_archs.CONFIGS[name]))
    spec = read_model_spec(str(tmp_path))
    layout = probe_cache_layout(model, weights_loaded=True)
    assert spec.geometry.kv_bytes_per_token == layout.bytes_per_token
    assert spec.geometry == geometry_for(model, layout)
    if name == "prism_hadamard_qwen35":  # two attention layers' KV, two layers' fixed state
        assert layout.kinds() == {"full": 2, "state": 2}
        assert spec.geometry.kv_layout == layout.kv_layout() and layout.fixed_bytes > 0


def test_the_probe_finds_rows_that_cannot_batch_and_caches_of_unusual_kinds() -> None:
    """gpt_bigcode makes positions from its offset as an int and phi3small's block-sparse
    attention cannot broadcast a per-row mask: rows step one at a time. deepseek_v41 keeps
    its own cache class (sized from what the probe left in it); nemotron-nas has layers
    without attention, whose caches stay empty."""
    for name in ("gpt_bigcode", "phi3small"):
        layout = probe_cache_layout(tiny_archs.build(name), weights_loaded=True)
        assert not layout.batched and not layout.plain_kv, name
    assert probe_cache_layout(tiny_archs.build("qwen3"), weights_loaded=True).plain_kv

    custom = probe_cache_layout(tiny_archs.build("deepseek_v41"), weights_loaded=True)
    assert custom.kinds() == {"custom": 4} and not custom.mergeable
    assert custom.bytes_for(100) == sum(c.bytes_per_token for c in custom.layers) * 256 > 0

    nas = probe_cache_layout(tiny_archs.build("nemotron-nas"), weights_loaded=True)
    assert [c.bytes_per_token == 0 for c in nas.layers] == [False, True, False]
    assert not nas.plain_kv


def test_the_probe_tells_layers_that_share_a_cache_from_layers_handed_its_kv() -> None:
    """Gemma 3n's KV-shared layers read an earlier layer's cache object and attend through
    it: every layer's attention names a cache entry, so the paged store serves it (shared
    layers answered from the owner's blocks). afm7's KV-reuse layers attend K/V they were
    handed, with no cache named: they stay on mlx-lm's caches, as iquestloopcoder does."""
    shared = probe_cache_layout(tiny_archs.build("gemma3n"), weights_loaded=True)
    assert shared.entries < shared.model_layers and shared.attends_through_entries
    assert shared.paged_windows is not None
    handed = probe_cache_layout(tiny_archs.build("afm7"), weights_loaded=True)
    assert handed.entries < handed.model_layers and not handed.attends_through_entries
    assert not handed.plain_kv and handed.paged_windows is None
    # iquestloopcoder's layers run twice, the second time naming its own entry while it
    # attends the first pass's K/V: every call names an entry, yet it is not served paged
    loop = probe_cache_layout(tiny_archs.build("iquestloopcoder"), weights_loaded=True)
    assert loop.entries > loop.model_layers and not loop.attends_through_entries
    assert loop.paged_windows is None


def test_rows_that_join_together_are_merged_into_the_batch_at_once(
    make_engine: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each `extend` of mlx-lm's batch caches copies the whole batch's KV: prompts that
    finish prefill in the same step join with one merge and one extend per layer, not one
    extend per row. Output stays mlx-lm's."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    loaded = tiny_archs.loaded("gemma3_text")
    extends: list[int] = []
    for cls in (BatchKVCache, BatchRotatingKVCache):
        original = cls.extend

        def counted(self, other, original=original):
            extends.append(other.keys.shape[0] if other.keys is not None else 0)
            return original(self, other)

        monkeypatch.setattr(cls, "extend", counted)
    layers = len(loaded.model.layers)
    prompts = [[(7 * i + j) % tiny_archs.VOCAB for j in range(6)] for i in range(5)]
    expected = [_reference(loaded.model, p, 6) for p in prompts]
    h = make_engine(loaded=loaded, paged_windows=False, prefill_step_size=STEP, prefix_cache_bytes=0)
    for i, p in enumerate(prompts[:4]):  # four 6-token prompts fit one step (32 tokens): they join together
        h.submit(EngineRequest(f"r{i}", tuple(p), 6, SamplingParams(temperature=0.0)))
    h.run_until(lambda: len(h.core.batch) == 4)
    h.step()  # the first decode step merges them: a batch is made, nothing extended
    assert extends == []
    h.submit(EngineRequest("r4", tuple(prompts[4]), 6, SamplingParams(temperature=0.0)))
    h.run_until(lambda: all(f"r{i}" in h.out.finished for i in range(5)))
    assert extends == [1] * layers  # the late row: one extend per layer
    assert [h.out.tokens[f"r{i}"] for i in range(5)] == expected
