"""The prefix cache's disk tier on the real tiny model: blocks written at shutdown (or when
evicted) are read back by a later engine, and give the same output as a cold prefill; a
damaged file, or one of another model, is removed and never loaded."""

from __future__ import annotations

import inspect
import json
import os
import random
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

import engine.core as engine_core
from engine import EngineRequest, SamplingParams, load_model
from engine.kv import KVGeometry, KVStore
from engine.prefix import PrefixCache
from engine.prefix.disk import DiskTier
from engine.prefix.keys import ROOT
from engine.step_budget import Line
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
    # Reading or prefilling is decided on measured speeds (a test of its own, below); a
    # known fast disk keeps this one from following the machine's load.
    again.core.prefix_cache.disk.read_bytes_per_s = 1e15
    follow_up = (*prompt(1), *prompt(2, 40))
    tokens, cached = run(again, "b", follow_up)
    assert cached == PROMPT // 16 * 16  # the prompt's full blocks, from disk
    assert tokens == cold("b", follow_up)
    disk = again.core.prefix_cache.stats().disk
    assert disk is not None and disk["hits"] == PROMPT // 16 and disk["rejected"] == 0


def test_blocks_evicted_from_memory_are_read_back(make_engine, tmp_path, cold):
    h = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    h.core.prefix_cache.disk.read_bytes_per_s = 1e15  # a known fast disk (see above)
    run(h, "a", prompt(1))
    assert not files(tmp_path)
    h.core.prefix_cache.evict(1 << 40)  # as admission would
    assert len(files(tmp_path)) == (PROMPT + 8) // 16 and not len(h.core.prefix_cache)
    tokens, cached = run(h, "b", prompt(1))
    assert cached == PROMPT // 16 * 16
    assert tokens == cold("b", prompt(1))


@pytest.mark.parametrize("run_blocks", [64, 5])
def test_a_hit_is_read_back_a_run_of_blocks_at_a_time(make_engine, tmp_path, cold, monkeypatch, run_blocks):
    """Each run of blocks is one array and one store update per layer, not one per block
    (that cost 0.9 GB/s on an H100); a run holds at most READ_BACK_BYTES."""
    first = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    run(first, "a", prompt(1))
    shut_down(first)
    again = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    disk, store = again.core.prefix_cache.disk, again.core.store
    # how a read runs, not whether it pays: that decision weighs speeds measured on this
    # machine, which another test's load beside this one can tip (the tests above decide it)
    monkeypatch.setattr(disk, "worth_reading", lambda blocks, prefill_s: blocks > 0)
    monkeypatch.setattr(engine_core, "READ_BACK_BYTES", run_blocks * disk.block_bytes)
    runs: list[int] = []
    load = store.load_blocks
    monkeypatch.setattr(store, "load_blocks", lambda rid, kv: (runs.append(kv.shape[1] // 16), load(rid, kv)))
    tokens, cached = run(again, "b", prompt(1))
    blocks = PROMPT // 16
    assert cached == blocks * 16
    assert runs == ([blocks] if run_blocks >= blocks else [5, 5, 2])
    assert tokens == cold("b", prompt(1))
    assert disk._buffer is None  # the host buffer goes back when the read-back ends


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


@pytest.mark.parametrize("how", ["spill", "evict"])
def test_writes_cut_short_by_time_leave_the_head_of_a_chain(make_engine, tmp_path, monkeypatch, how):
    """A lookup after a restart walks from a prompt's first block, so a block on disk is
    of use only when the blocks before it are too: writes cut short by their time must
    have written a chain's head, not its tail."""
    h = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    run(h, "a", prompt(1))
    ticks = iter(range(1_000_000))  # a clock that moves one tick each time it is read
    monkeypatch.setattr("engine.prefix.cache.time", SimpleNamespace(monotonic=lambda: next(ticks)))
    monkeypatch.setattr("engine.prefix.cache.EVICT_WRITE_S", 4)
    if how == "spill":
        h.core.prefix_cache.spill(deadline=4)
    else:
        h.core.prefix_cache.evict(1 << 40)
    parents = {}
    for f in files(tmp_path):
        parents[bytes.fromhex(f.stem)] = bytes.fromhex(mx.load(str(f), return_metadata=True)[1]["parent"])
    assert 0 < len(parents) < (PROMPT + 8) // 16  # the time ran out part of the way
    assert all(parent == ROOT or parent in parents for parent in parents.values())
    again = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    assert run(again, "b", prompt(1))[1] == 16 * len(parents)  # every block written is read back


def test_a_chain_deeper_than_pythons_recursion_limit_is_evicted_whole(make_engine, tmp_path):
    """A chain is a prompt's blocks (a 100k-token prompt is 6,250 deep): evicting it from its
    head must not recurse once per block. Here the stack may grow by 60 frames, and the
    chain is 125 blocks deep."""
    h = make_engine(prefill_step_size=512, prefix_cache_dir=str(tmp_path))
    run(h, "a", prompt(1, 2000))
    cache = h.core.prefix_cache
    assert len(cache) == -(-2008 // 16)  # 125 full blocks and the partial last one
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 60)
    try:
        cache.evict(1 << 40)
    finally:
        sys.setrecursionlimit(limit)
    assert not len(cache) and len(files(tmp_path)) == 2008 // 16  # full blocks go to disk


def test_a_chain_spilled_to_a_full_tier_loses_its_leaves_first(make_engine, tmp_path):
    """At shutdown the tier keeps what it holds of the most recent chain, from its head."""
    h = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    run(h, "a", prompt(1))
    disk = h.core.prefix_cache.disk
    disk.max_bytes = 5 * disk.block_bytes + disk.block_bytes // 2  # five of its 13 blocks fit
    assert h.core.prefix_cache.spill() == 5
    again = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    assert run(again, "b", prompt(1))[1] == 5 * 16


# ---- the tier alone: its cap and its read-or-prefill decision ---------------------------
BS = 4
ROW = ((2, 8), mx.float32)


def tier(root: Path, max_bytes: int = 1 << 30) -> DiskTier:
    return DiskTier(root, "test", max_bytes=max_bytes, block_size=BS, row_shape=ROW, num_layers=2)


def write(disk: DiskTier, name: int) -> bytes:
    """One block's file, keyed and filled by `name`; its key."""
    key = bytes([name]) * 16
    arrays = [mx.full((BS, *ROW[0]), float(name), ROW[1]) for _ in range(4)]
    disk.write(key, ROOT, (name,) * BS, arrays)
    return key


def on_disk(disk: DiskTier) -> tuple[set[bytes], int]:
    """The keys of the folder's files, and their bytes, as the directory has them."""
    found = list(disk.dir.glob("*.safetensors"))
    return {bytes.fromhex(f.stem) for f in found}, sum(f.stat().st_size for f in found)


def test_the_folder_stays_under_its_cap_least_recently_used_files_first(tmp_path):
    first = tier(tmp_path / "size")
    write(first, 10)
    size = first.nbytes
    cap = 3 * size + size // 2  # three files fit, four do not
    disk = tier(tmp_path / "disk", cap)
    a, b, c = (write(disk, n) for n in (11, 12, 13))
    assert on_disk(disk)[0] == {a, b, c}
    assert disk.read_blocks([(a, ROOT, (11,) * BS)]) is not None  # a read makes a the most recent
    d = write(disk, 14)
    keys, nbytes = on_disk(disk)
    assert keys == {a, c, d} and nbytes <= cap and disk.nbytes == nbytes  # b, least recent, went
    e = write(disk, 15)
    keys, nbytes = on_disk(disk)
    assert keys == {a, d, e} and nbytes <= cap
    # A restart under a smaller cap keeps the most recent by the files' times (a read
    # touches its file): here d is made the oldest, so it goes first.
    for age, key in enumerate((e, a, d)):
        os.utime(disk.path(key), ns=(10**18 - age * 10**9, 10**18 - age * 10**9))
    smaller = tier(tmp_path / "disk", 2 * size + size // 2)
    keys, nbytes = on_disk(smaller)
    assert keys == {a, e} and nbytes <= smaller.max_bytes


def test_reading_back_is_chosen_only_when_it_is_faster_than_prefilling(tmp_path):
    disk = tier(tmp_path)
    disk.read_bytes_per_s = float(disk.block_bytes)  # one block a second, until reads are timed
    assert disk.worth_reading(3, prefill_s=3.03)  # prefilling them would take a little longer
    assert not disk.worth_reading(3, prefill_s=2.97)  # a little shorter
    assert disk.worth_reading(3, prefill_s=None)  # no prefill measured yet: reading wins
    assert not disk.worth_reading(0, prefill_s=10.0)


def test_the_decision_prices_prefill_at_the_context_the_blocks_attend(tmp_path):
    """Prefill dearer per token deep in a prompt (attention) than at its start: the same
    blocks on disk are worth reading after 16 cached tokens, not after none."""
    store = KVStore(KVGeometry(2, 2, 8, mx.float32), block_size=BS, segment_tokens=64)
    cache = PrefixCache(store)
    cache.disk = tier(tmp_path)
    tokens = list(range(100, 124))  # six full blocks

    def cached(rid: str, n: int) -> None:
        store.reserve(rid, n + 1)
        store.advance(rid, n)
        cache.insert(tokens[:n], store.hold_prefix(rid, n))
        store.release(rid)

    cached("a", 24)
    cache.evict_lru(len(cache), cause="cap")  # all six blocks go to disk
    line = Line(per_token_s=0.0, per_context_s=1e-3)
    cache.prefill_seconds = lambda context, n: line.seconds(context, n)
    # Reading a block takes 64 ms; prefilling it costs 48 ms a block over blocks 0-5 (context
    # 0-24) and 80 ms a block over blocks 4-5 (context 16-24).
    cache.disk.read_bytes_per_s = cache.disk.block_bytes / 0.064
    assert cache.lookup([*tokens, 7]) is None  # cheaper to prefill from the start
    cached("b", 16)  # blocks 0-3 back in memory
    hit = cache.lookup([*tokens, 7])
    assert hit is not None and hit.cached_tokens == 24 and len(hit.disk) == 2


def test_the_engine_prices_prefill_by_its_fitted_cost_line(make_engine, tmp_path):
    h = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    run(h, "a", prompt(1))
    line = h.core.step_budget.cost.line
    assert line is not None
    assert h.core.prefix_cache.prefill_seconds(4096, 64) == line.seconds(4096, 64)


# ---- what a restarted process decides from: the measurements the folder keeps -----------
def calibration(root: Path) -> Path:
    (found,) = root.glob("*/calibration.json")
    return found


def test_a_restarted_engine_starts_from_the_measurements_of_the_last(make_engine, tmp_path):
    """Right after a restart nothing is measured yet: a warm-up's few tokens would price a
    long prefill at their own fixed cost. The folder keeps the prefill cost line and the read
    rate, and the next process begins from them."""
    first = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    run(first, "a", prompt(1))
    line = first.core.step_budget.cost.line
    rate = first.core.prefix_cache.disk.bytes_per_s
    shut_down(first)
    saved = json.loads(calibration(tmp_path).read_text())
    assert saved["read_bytes_per_s"] == rate and saved["prefill"]
    again = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    assert again.core.step_budget.cost.line == pytest.approx(line)  # before any prefill here
    assert again.core.prefix_cache.disk.read_bytes_per_s == rate
    again.core.step_budget.forget()  # as after the warm-up: back to the prior, not to nothing
    assert again.core.step_budget.cost.line == pytest.approx(line)


@pytest.mark.parametrize(("read_bytes_per_s", "read"), [(1.0, False), (1e15, True)])
def test_after_a_restart_blocks_are_read_only_when_reading_beats_prefilling(
        make_engine, tmp_path, cold, read_bytes_per_s, read):
    """A disk that reads slower than the model prefills (measured by the last process: an
    H100 read a 32k prefix's 4 GiB in 4.7 s and prefilled it in 2.1 s) is not read."""
    first = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    run(first, "a", prompt(1))
    shut_down(first)
    path = calibration(tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "read_bytes_per_s": read_bytes_per_s}))
    again = make_engine(prefill_step_size=128, prefix_cache_dir=str(tmp_path))
    tokens, cached = run(again, "b", prompt(1))
    assert tokens == cold("b", prompt(1))
    assert cached == (PROMPT // 16 * 16 if read else 0)
    assert again.core.prefix_cache.stats().disk["hits"] == (PROMPT // 16 if read else 0)


def test_a_foreign_or_damaged_calibration_is_removed_and_never_used(tmp_path):
    disk = tier(tmp_path)
    path = disk.dir / "calibration.json"
    ours = {"format": "mlx-headroom-prefix/1", "model": "test"}
    for text in ("{not json", "[]", json.dumps({**ours, "format": "other", "read_bytes_per_s": 1.0}),
                 json.dumps({**ours, "read_bytes_per_s": "fast"}),
                 json.dumps({**ours, "read_bytes_per_s": -1.0})):
        path.write_text(text)
        again = tier(tmp_path)
        assert again.calibration == {} and not path.exists() and again.read_bytes_per_s > 1.0
    disk.save_calibration(None)
    assert tier(tmp_path).read_bytes_per_s == disk.bytes_per_s  # its own is read back
