"""The prefix cache's disk tier on the real tiny model: blocks written at shutdown (or when
evicted) are read back by a later engine, and give the same output as a cold prefill; a
damaged file, or one of another model, is removed and never loaded."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from engine import EngineRequest, SamplingParams, load_model
from engine.tiny_model import TinyModelShape, build_tiny_model

GREEDY = SamplingParams(temperature=0.0)
PROMPT = 200  # 12 full blocks and a partial one


def prompt(seed: int, n: int = PROMPT) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(0, 256) for _ in range(n))


def run(h, rid: str, tokens: tuple[int, ...], max_tokens: int = 8) -> tuple[list[int], int]:
    h.submit(EngineRequest(rid, tokens, max_tokens, GREEDY))
    h.run_until(lambda: rid in h.out.finished)
    assert h.out.finished[rid] == "length"
    return h.out.tokens[rid], h.out.cached[rid]


def shut_down(h) -> None:
    """The engine thread's own ending: the loop stops, the cache goes to disk."""
    h.core.stop()
    h.core.run_forever()


def files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.safetensors"))


@pytest.fixture
def cold(make_engine):
    """Outputs with no prefix cache at all."""
    h = make_engine(prefill_step_size=128, prefix_cache_bytes=0)
    return lambda rid, tokens: run(h, rid, tokens)[0]


def test_a_restarted_engine_reads_the_prefix_back_from_disk(make_engine, tmp_path, cold):
    first = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    run(first, "a", prompt(1))
    shut_down(first)
    written = files(tmp_path)
    assert len(written) == (PROMPT + 8) // 16  # the full blocks of prompt and answer
    again = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    follow_up = (*prompt(1), *prompt(2, 40))
    tokens, cached = run(again, "b", follow_up)
    assert cached == PROMPT // 16 * 16  # the prompt's full blocks, from disk
    assert tokens == cold("b", follow_up)
    disk = again.core.prefix_cache.stats().disk
    assert disk is not None and disk["hits"] == PROMPT // 16 and disk["rejected"] == 0


def test_blocks_evicted_from_memory_are_read_back(make_engine, tmp_path, cold):
    h = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    run(h, "a", prompt(1))
    assert not files(tmp_path)
    h.core.prefix_cache.evict(1 << 40)  # as admission would
    assert len(files(tmp_path)) == (PROMPT + 8) // 16 and not len(h.core.prefix_cache)
    tokens, cached = run(h, "b", prompt(1))
    assert cached == PROMPT // 16 * 16
    assert tokens == cold("b", prompt(1))


def test_a_damaged_file_is_removed_and_never_loaded(make_engine, tmp_path, cold):
    first = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    run(first, "a", prompt(1))
    shut_down(first)
    again = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    chain = again.core.prefix_cache  # the prompt's block keys, in order
    memo: list[bytes] = []
    assert chain.lookup(prompt(1), count=False, memo=memo) is not None
    by_key = {f.stem: f for f in files(tmp_path)}
    torn, garbled = by_key[memo[5].hex()], by_key[memo[8].hex()]
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    garbled.write_bytes(b"\0" * 64 + garbled.read_bytes()[64:])
    tokens, cached = run(again, "b", prompt(1))
    assert cached == 5 * 16  # read up to the torn file, the rest prefilled
    assert not torn.exists()
    assert tokens == cold("b", prompt(1))
    tokens, cached = run(again, "c", (*prompt(1), 7))  # now cached in memory up to block 8
    assert tokens == cold("c", (*prompt(1), 7))
    assert again.core.prefix_cache.stats().disk["rejected"] >= 1


def test_a_file_of_another_model_is_never_used(make_engine, tmp_path, cold):
    first = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path / "cache"))
    run(first, "a", prompt(1))
    shut_down(first)
    (ours,) = {f.parent for f in files(tmp_path / "cache")}
    # The same shape and tokenizer with other weights: another identity, another folder.
    other = load_model(str(build_tiny_model(tmp_path / "other", TinyModelShape(seed=1))),
                       model_id="other")
    h = make_engine(loaded=other, prefill_step_size=128, prefix_cache_dir=str(tmp_path / "cache"))
    theirs = h.core.prefix_cache.disk.dir
    assert theirs != ours
    tokens, cached = run(h, "b", prompt(1))
    assert cached == 0
    # Even moved into its folder under the names it would look for, the files are refused.
    for f in ours.glob("*.safetensors"):
        shutil.copy(f, theirs / f.name)
    copied = len(list(theirs.glob("*.safetensors")))
    h2 = make_engine(loaded=other, prefill_step_size=128, prefix_cache_dir=str(tmp_path / "cache"))
    tokens2, cached = run(h2, "c", prompt(1))
    assert cached == 0 and tokens2 == tokens
    assert h2.core.prefix_cache.stats().disk["rejected"] == 1  # the first block's: the read stops
    assert len(list(theirs.glob("*.safetensors"))) == copied - 1  # and that file is gone


def test_an_eviction_writes_for_a_bounded_time(make_engine, tmp_path, monkeypatch):
    """Writes run on the engine thread: past the eviction's time for them, the rest of the
    blocks are dropped and counted, not written."""
    monkeypatch.setattr("engine.prefix.cache.EVICT_WRITE_S", -1.0)  # no time at all
    h = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    run(h, "a", prompt(1))
    h.core.prefix_cache.evict(1 << 40)
    assert not files(tmp_path) and not len(h.core.prefix_cache)
    assert h.core.prefix_cache.stats().disk["unwritten"] == (PROMPT + 8) // 16
