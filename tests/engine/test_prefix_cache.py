"""PrefixCache: longest-prefix hits, byte accounting, LRU eviction, protection."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.prefix_cache import PrefixCache

LAYERS = 2


def kv(tokens: int) -> list[KVCache]:
    caches = []
    for _ in range(LAYERS):
        c = KVCache()
        c.update_and_fetch(mx.ones((1, 2, tokens, 8)), mx.ones((1, 2, tokens, 8)))
        caches.append(c)
    return caches


def entry_bytes(tokens: int) -> int:
    return sum(c.nbytes for c in kv(tokens))


def test_miss_then_longest_prefix_hit_trimmed_to_the_common_part():
    cache = PrefixCache(max_bytes=1 << 30, max_entries=8)
    assert cache.lookup([1, 2, 3]) is None
    cache.insert([1, 2, 3, 4, 5], kv(5))
    cache.insert([9, 9, 9], kv(3))
    hit = cache.lookup([1, 2, 3, 7, 8])
    assert hit is not None and hit.cached_tokens == 3 and hit.key == (1, 2, 3, 4, 5)
    assert all(c.offset == 3 for c in hit.caches)
    assert (cache.hits, cache.misses) == (1, 1)


def test_at_most_all_but_the_last_prompt_token_is_reused():
    cache = PrefixCache(max_bytes=1 << 30, max_entries=8)
    cache.insert([1, 2, 3], kv(3))
    hit = cache.lookup([1, 2, 3])
    assert hit is not None and hit.cached_tokens == 2


def test_a_hit_shares_arrays_and_writing_leaves_the_entry_intact():
    cache = PrefixCache(max_bytes=1 << 30, max_entries=8)
    cache.insert([1, 2, 3, 4], kv(4))
    hit = cache.lookup([1, 2, 9, 9])
    assert hit is not None
    hit.caches[0].update_and_fetch(mx.zeros((1, 2, 2, 8)), mx.zeros((1, 2, 2, 8)))
    again = cache.lookup([1, 2, 3, 4, 5])
    assert again is not None
    keys = again.caches[0].keys[..., :4, :]
    assert mx.all(keys == 1).item()


def test_insert_drops_entries_that_are_its_prefix_and_skips_dominated_ones():
    cache = PrefixCache(max_bytes=1 << 30, max_entries=8)
    cache.insert([1, 2], kv(2))
    cache.insert([1, 2, 3, 4], kv(4))
    assert cache.keys() == [(1, 2, 3, 4)]
    cache.insert([1, 2, 3], kv(3))
    assert cache.keys() == [(1, 2, 3, 4)]


def test_byte_and_entry_limits_evict_least_recently_used():
    size = entry_bytes(4)
    cache = PrefixCache(max_bytes=2 * size, max_entries=8)
    cache.insert([1, 1, 1, 1], kv(4))
    cache.insert([2, 2, 2, 2], kv(4))
    cache.lookup([1, 1, 1, 5])  # touch the first
    cache.insert([3, 3, 3, 3], kv(4))
    assert cache.keys() == [(1, 1, 1, 1), (3, 3, 3, 3)]
    assert cache.nbytes == 2 * size and cache.evictions == 1
    small = PrefixCache(max_bytes=1 << 30, max_entries=1)
    small.insert([1, 1], kv(2))
    small.insert([2, 2], kv(2))
    assert small.keys() == [(2, 2)]


def test_evict_frees_lru_first_and_never_a_protected_entry():
    size = entry_bytes(4)
    cache = PrefixCache(max_bytes=1 << 30, max_entries=8)
    for t in (1, 2, 3):
        cache.insert([t] * 4, kv(4))
    protect = frozenset({(1, 1, 1, 1)})
    assert cache.evictable_bytes(protect) == 2 * size
    freed = cache.evict(1, protect)
    assert freed == size
    assert cache.keys() == [(1, 1, 1, 1), (3, 3, 3, 3)]
    assert cache.evict(10 * size, protect) == size
    assert cache.keys() == [(1, 1, 1, 1)]
    assert cache.nbytes == size
