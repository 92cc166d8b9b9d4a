"""PrefixCache over the KV store's blocks: longest-prefix hits, byte accounting, LRU
eviction, protection, and holds released when entries go."""

from __future__ import annotations

import mlx.core as mx

from engine.kv import KVGeometry, KVStore
from engine.prefix_cache import PrefixCache

BS = 4


def store() -> KVStore:
    return KVStore(KVGeometry(2, 2, 8, mx.float32), block_size=BS, segment_tokens=16)


def cached(cache: PrefixCache, rid: str, tokens: list[int]) -> None:
    """A request that ran `tokens` and then left; its prefix stays in the cache."""
    s = cache.store
    s.reserve(rid, len(tokens) + 1)
    s.advance(rid, len(tokens))
    prefix = s.hold_prefix(rid, len(tokens))
    assert prefix is not None
    cache.insert(tokens, prefix)
    s.release(rid)


def test_miss_then_longest_prefix_hit_trimmed_to_the_common_part():
    cache = PrefixCache(store(), max_bytes=1 << 30, max_entries=8)
    assert cache.lookup([1, 2, 3]) is None
    cached(cache, "a", [1, 2, 3, 4, 5, 6])
    cached(cache, "b", [9, 9, 9])
    hit = cache.lookup([1, 2, 3, 4, 5, 7, 8])
    assert hit is not None and hit.cached_tokens == 5 and hit.key == (1, 2, 3, 4, 5, 6)
    assert len(hit.prefix.blocks) == 2  # one full block shared, one partial to copy
    assert (cache.hits, cache.misses) == (1, 1)


def test_at_most_all_but_the_last_prompt_token_is_reused():
    cache = PrefixCache(store(), max_bytes=1 << 30, max_entries=8)
    cached(cache, "a", [1, 2, 3])
    hit = cache.lookup([1, 2, 3])
    assert hit is not None and hit.cached_tokens == 2


def test_a_hit_shares_full_blocks_and_copies_only_the_partial_one():
    s = KVStore(KVGeometry(2, 2, 8, mx.float32), block_size=BS, segment_tokens=64)
    cache = PrefixCache(s, max_bytes=1 << 30, max_entries=8)
    cached(cache, "a", list(range(10)))
    entry_blocks = cache.lookup([*range(10), 99]).prefix.blocks  # type: ignore[union-attr]
    hit = cache.lookup([*range(6), 50, 51, 52])
    assert hit is not None and hit.cached_tokens == 6
    b = s.reserve("b", 12, hit.prefix)
    assert b.table[0] == entry_blocks[0] and b.table[1] != entry_blocks[1]
    assert b.length == 6
    seg = b.segment
    assert seg.blocks.refs(entry_blocks[0]) == 2 and seg.blocks.refs(entry_blocks[1]) == 1


def test_insert_drops_entries_that_are_its_prefix_and_skips_dominated_ones():
    cache = PrefixCache(store(), max_bytes=1 << 30, max_entries=8)
    cached(cache, "a", [1, 2])
    cached(cache, "b", [1, 2, 3, 4])
    assert cache.keys() == [(1, 2, 3, 4)]
    cached(cache, "c", [1, 2, 3])
    assert cache.keys() == [(1, 2, 3, 4)]
    assert cache.store.segments and all(seg.blocks.used == 1 for seg in cache.store.segments.values())


def test_byte_and_entry_limits_evict_least_recently_used():
    size = 1 * store().block_bytes
    cache = PrefixCache(store(), max_bytes=2 * size, max_entries=8)
    cached(cache, "a", [1, 1, 1, 1])
    cached(cache, "b", [2, 2, 2, 2])
    cache.lookup([1, 1, 1, 5])  # touch the first
    cached(cache, "c", [3, 3, 3, 3])
    assert cache.keys() == [(1, 1, 1, 1), (3, 3, 3, 3)]
    assert cache.nbytes == 2 * size and cache.evictions == 1
    small = PrefixCache(store(), max_bytes=1 << 30, max_entries=1)
    cached(small, "a", [1, 1])
    cached(small, "b", [2, 2])
    assert small.keys() == [(2, 2)]


def test_evict_frees_whole_segments_lru_first_and_never_a_protected_entry():
    s = KVStore(KVGeometry(2, 2, 8, mx.float32), block_size=BS, segment_tokens=4)  # 1 block each
    cache = PrefixCache(s, max_bytes=1 << 30, max_entries=8)
    for t in (1, 2, 3):
        cached(cache, f"r{t}", [t] * 3)
    segment = s.segments[0].nbytes
    assert s.pool_bytes() == 3 * segment
    protect = frozenset({(1, 1, 1)})
    assert cache.evictable_bytes(protect) == 2 * segment
    assert cache.evict(1, protect) == segment
    assert cache.keys() == [(1, 1, 1), (3, 3, 3)]
    assert cache.evict(10 * segment, protect) == segment
    assert cache.keys() == [(1, 1, 1)] and s.pool_bytes() == segment
    cache.clear()
    assert s.pool_bytes() == 0 and not s.segments


def test_a_shared_prefix_shorter_than_the_minimum_is_a_miss():
    """The engine asks for a block at least: a chat template's few shared tokens are no hit."""
    cache = PrefixCache(store(), max_bytes=1 << 30, max_entries=8, min_hit_tokens=BS)
    cached(cache, "a", [1, 2, 3, 4, 5, 6])
    assert cache.lookup([1, 2, 3, 9, 9]) is None
    hit = cache.lookup([1, 2, 3, 4, 9])
    assert hit is not None and hit.cached_tokens == BS
    assert (cache.hits, cache.misses) == (1, 1)
