"""A decode step's gathered K/V (engine.kv.decode_transient): measured on the CPU, and
asked for by admission when a request would join the decoding batch.

On the CPU (and Metal) each layer of a decode step gathers the batch's K/V out of the pool
into one [rows, heads, longest, dim] array. That is memory the store does not hold and a
prefill estimate does not see; a batch that fits at rest can overrun the ceiling while it
steps. The model here has 8 layers of 8 KV heads × 64 in float32: 4 KiB per token per
layer, so 8 rows of 1k tokens gather 32 MiB per layer."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import mlx.core as mx
import pytest

from engine import EngineRequest, LoadedModel, SamplingParams, load_model
from engine.kv import KVStore
from engine.kv.decode_transient import decode_gather_bytes
from memory import MemoryGuard
from memory.ceiling import Tier
from tests.engine.conftest import Harness
from tests.memory.memtest_helpers import FixedProbe, GiB, snap

CONFIG = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
          "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 1024, "vocab_size": 512,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": True}
PROMPT, NEW = 1024, 64
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = tmp_path_factory.mktemp("decode-transient") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return load_model(str(path), load_format="dummy", dtype="float32")


def _request(i: int) -> EngineRequest:
    rng = random.Random(i)
    return EngineRequest(f"r{i}", tuple(rng.randrange(256) for _ in range(PROMPT)), NEW, GREEDY)


def _decoding(h: Harness, rows: int) -> None:
    for i in range(rows):
        h.submit(_request(i))
    h.run_until(lambda: len(h.core.batch.seqs) == rows)


def test_a_decode_steps_gathers_are_what_the_estimate_says_on_the_cpu(
        make_engine: Callable[..., Harness], layered: LoadedModel) -> None:
    h = make_engine(loaded=layered, prefill_step_size=PROMPT, prefix_cache_bytes=0)
    _decoding(h, 8)
    h.step()
    mx.synchronize()
    mx.clear_cache()
    rest = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(3):
        h.step()
    mx.synchronize()
    measured = mx.get_peak_memory() - rest
    assert isinstance(h.core.store, KVStore)
    predicted = decode_gather_bytes(h.core.store, [PROMPT + NEW] * 8)
    one_layer = 8 * (PROMPT + NEW) * 4096
    assert predicted == one_layer  # the CPU frees each layer's gather before the next
    assert predicted // 2 < measured <= predicted + (4 << 20), (measured, predicted)


def test_a_request_that_would_make_the_batch_gather_past_the_ceiling_waits(
        make_engine: Callable[..., Harness], layered: LoadedModel) -> None:
    footprint = 2 * GiB
    guard = MemoryGuard(FixedProbe(snap(footprint_bytes=footprint, allocator_active_bytes=footprint)),
                        enabled=True, tier=Tier.CUSTOM, custom_ceiling_bytes=64 * GiB)
    h = make_engine(guard=guard, loaded=layered, prefill_step_size=PROMPT, prefix_cache_bytes=0)
    _decoding(h, 3)
    h.submit(_request(3))
    core, admission = h.core, h.core.admission
    (seq,) = core.waiting
    admitted = core._admitted()
    rest = (footprint + admission.committed_bytes(admitted, core._allocated_kv())
            + min(admission.growth_bytes(seq, exact=e) for e in (False, True))  # a segment sized to it
            + admission.full_chunk_prediction(seq))
    gathered = admission.decode_transient_bytes([*admitted, seq])
    assert gathered == 4 * -(-(PROMPT + NEW) // 16) * 16 * 4096  # four rows, one layer at a time

    guard.configure(ceiling_bytes=rest + gathered // 2)  # room for its reservation, not the gathers
    for _ in range(3):
        h.step()
    assert seq in core.waiting and len(core.batch.seqs) == 3
    assert guard.recent_refusals()[-1].request_id == seq.request_id

    guard.configure(ceiling_bytes=rest + gathered + (1 << 20))
    h.run_until(lambda: seq not in core.waiting)
    h.run_until(lambda: all(f"r{i}" in h.out.finished for i in range(4)))
