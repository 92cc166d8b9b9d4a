"""PrefixCache over the KV store's blocks: chain-hash lookups, partial blocks, LRU leaves
first, eviction whole segments or in place, protection, and holds released as blocks go."""

from __future__ import annotations

import mlx.core as mx

from engine.kv import KVGeometry, KVStore
from engine.prefix import PrefixCache
from engine.prefix import cache as prefix_cache_module

BS = 4


def store(segment_tokens: int = 16) -> KVStore:
    return KVStore(KVGeometry(2, 2, 8, mx.float32), block_size=BS, segment_tokens=segment_tokens)


def cached(cache: PrefixCache, rid: str, tokens: list[int]) -> None:
    """A request that ran `tokens` and then left; its blocks stay in the cache."""
    s = cache.store
    s.reserve(rid, len(tokens) + 1)
    s.advance(rid, len(tokens))
    prefix = s.hold_prefix(rid, len(tokens))
    assert prefix is not None
    cache.insert(tokens, prefix)
    s.release(rid)


def test_miss_then_longest_prefix_hit_trimmed_to_the_common_part():
    cache = PrefixCache(store())
    assert cache.lookup([1, 2, 3]) is None
    cached(cache, "a", [1, 2, 3, 4, 5, 6])
    cached(cache, "b", [9, 9, 9])
    hit = cache.lookup([1, 2, 3, 4, 5, 7, 8])
    assert hit is not None and hit.cached_tokens == 5
    assert len(hit.prefix.blocks) == 2  # one full block shared, one partial to copy
    assert (cache.hits, cache.misses) == (1, 1)


def test_at_most_all_but_the_last_prompt_token_is_reused():
    cache = PrefixCache(store())
    cached(cache, "a", [1, 2, 3])
    hit = cache.lookup([1, 2, 3])
    assert hit is not None and hit.cached_tokens == 2


def test_a_hit_shares_full_blocks_and_copies_only_the_partial_one():
    s = store(64)
    cache = PrefixCache(s)
    cached(cache, "a", list(range(10)))
    entry_blocks = cache.lookup([*range(10), 99]).prefix.blocks  # type: ignore[union-attr]
    hit = cache.lookup([*range(6), 50, 51, 52])
    assert hit is not None and hit.cached_tokens == 6
    b = s.reserve("b", 12, hit.prefix)
    assert b.table[0] == entry_blocks[0] and b.table[1] != entry_blocks[1]
    assert b.length == 6
    seg = b.segment
    assert seg.blocks.refs(entry_blocks[0]) == 2 and seg.blocks.refs(entry_blocks[1]) == 1


def test_a_longer_turn_extends_the_chain_and_replaces_its_partial_block():
    s = store(64)
    cache = PrefixCache(s)
    cached(cache, "a", [1, 2, 3, 4, 5, 6])  # a full block and a partial one
    assert len(cache) == 2
    cached(cache, "b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # the same chain, longer
    assert len(cache) == 3  # [1-4], [5-8], [9]: the partial [5, 6] is gone
    hit = cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert hit is not None and hit.cached_tokens == 9
    cached(cache, "c", [1, 2, 3])  # dominated: nothing new
    assert len(cache) == 3
    assert sum(seg.blocks.used for seg in s.segments.values()) == 3


def test_a_lookup_costs_the_prompts_length_not_the_number_of_entries(monkeypatch):
    """Digests are computed block by block until the first miss, whatever the cache holds;
    the partial block looked for after a miss is compared with a few children, not with
    every root (every cached conversation), even when many share their first tokens."""
    s = store(4096)
    cache = PrefixCache(s)
    for i in range(200):
        cached(cache, f"r{i}", [i + 1000] * 8)
        cached(cache, f"t{i}", [5, 5, i + 1000, i + 1000, *[i + 1000] * 4])  # a shared template
    compared: list[int] = []

    def counted(a, b) -> int:
        compared.append(1)
        return common(a, b)

    common = prefix_cache_module._common
    monkeypatch.setattr(prefix_cache_module, "_common", counted)
    memo: list[bytes] = []
    assert cache.lookup([7] * 40, memo=memo) is None
    assert len(memo) == 1  # the first block missed: nothing else was hashed
    assert len(compared) <= 2  # the block's neighbours in the roots' order
    compared.clear()
    hit = cache.lookup([5, 5, 1100, 9, *[7] * 36])
    assert hit is not None and hit.cached_tokens == 3  # the partial block found among 200 alike
    assert len(compared) <= 4


def test_cap_evicts_least_recently_used_leaves_first():
    s = store(64)
    block = s.block_bytes
    cache = PrefixCache(s, max_bytes=3 * block)
    cached(cache, "a", [1, 1, 1, 1, 2, 2, 2, 2])  # two blocks
    cached(cache, "b", [3, 3, 3, 3])
    assert cache.lookup([1, 1, 1, 1, 9, 9]) is not None  # touches a's first block only
    cached(cache, "c", [4, 4, 4, 4])
    # a's second block was least recent (a's first was touched after it), and went first
    assert cache.nbytes == 3 * block and cache.evicted["cap"] == 1
    hit = cache.lookup([1, 1, 1, 1, 2, 2, 2, 2, 9])
    assert hit is not None and hit.cached_tokens == 4
    assert PrefixCache(s, max_bytes=0).lookup([1, 2]) is None


def test_evict_frees_whole_segments_lru_first_and_never_a_protected_chain():
    s = store(4)  # one block per segment
    cache = PrefixCache(s)
    for t in (1, 2, 3):
        cached(cache, f"r{t}", [t] * 3)
    segment = s.segments[0].nbytes
    assert s.pool_bytes() == 3 * segment
    protect = frozenset({cache.lookup([1, 1, 1, 1]).key})  # type: ignore[union-attr]
    assert cache.evictable_bytes(protect) == 2 * segment
    assert cache.evict(1, protect) == segment
    assert cache.lookup([2, 2, 2, 9]) is None and cache.lookup([3, 3, 3, 9]) is not None
    assert cache.evict(10 * segment, protect) == segment
    assert len(cache) == 1 and s.pool_bytes() == segment
    assert cache.evicted["admission"] == 2
    cache.clear()
    assert s.pool_bytes() == 0 and not s.segments and cache.evictions == 2


def test_a_live_segment_gives_room_in_place():
    s = store(16)  # four blocks
    cache = PrefixCache(s)
    cached(cache, "a", [1] * 7)  # blocks 0, 1
    cached(cache, "b", [2] * 7)  # blocks 2, 3
    assert len(s.segments) == 1 and s.free_blocks(0) == 0
    assert cache.evictable_bytes() == s.pool_bytes()  # only the cache holds it
    assert cache.room_in_segment(3) == 0 and cache.room_in_segment(5) is None
    protect = frozenset({cache.lookup([2] * 8, count=False).key})  # type: ignore[union-attr]
    assert cache.room_in_segment(3, protect) is None  # b's two blocks stay
    assert cache.evict_in_segment(0, lambda: s.free_blocks(0) >= 3) == 3
    assert cache.lookup([1] * 5) is None  # a, the least recent, went whole; then b's tail
    hit = cache.lookup([2] * 9)
    assert hit is not None and hit.cached_tokens == 4
    assert cache.evicted["admission"] == 3


def test_a_shared_prefix_shorter_than_the_minimum_is_a_miss():
    """The engine asks for a block at least: a chat template's few shared tokens are no hit."""
    cache = PrefixCache(store(), min_hit_tokens=BS)
    cached(cache, "a", [1, 2, 3, 4, 5, 6])
    assert cache.lookup([1, 2, 3, 9, 9]) is None
    hit = cache.lookup([1, 2, 3, 4, 9])
    assert hit is not None and hit.cached_tokens == BS
    assert (cache.hits, cache.misses) == (1, 1)
