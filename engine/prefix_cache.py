"""A prefix (KV) cache over the KV store's blocks: byte accounting, LRU, protection.

Entries are keyed by a prompt prefix's token ids and hold references on the whole
blocks of the store that contain its KV (`SharedPrefix`). A hit lends those blocks to
the new request, which references them too: nothing is copied, and an entry can be
evicted while a request that hit it still runs (the blocks stay until both let go).
A hit covers the whole common prefix: full blocks are shared, and the few tokens of a
partly filled last block are copied (copy-on-write of at most one block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.kv import KVStore, SharedPrefix

TokenKey = tuple[int, ...]


@dataclass(frozen=True)
class PrefixHit:
    key: TokenKey
    cached_tokens: int
    prefix: SharedPrefix


@dataclass(frozen=True)
class PrefixCacheStats:
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    max_bytes: int
    max_entries: int


@dataclass
class _Entry:
    tokens: np.ndarray
    prefix: SharedPrefix
    nbytes: int


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    def __init__(
        self, store: KVStore, *, max_bytes: int, max_entries: int, min_hit_tokens: int = 1
    ) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        # A shorter shared prefix is a miss. The engine passes a block: below that a hit
        # saves nothing (a chat template's first few tokens) yet costs a copy-on-write of
        # the block and moves the prompt's chunks off offset 0, where batched prefill rows
        # keep the fused causal path.
        self.min_hit_tokens = max(min_hit_tokens, 1)
        self._entries: OrderedDict[TokenKey, _Entry] = OrderedDict()  # LRU first
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def lookup(self, tokens: Sequence[int]) -> PrefixHit | None:
        """The entry sharing the longest prefix with `tokens`, trimmed to that prefix.

        At most `len(tokens) - 1` tokens are reused: the last prompt token must run
        through the model to produce the first output token.
        """
        if not self._entries or len(tokens) < 2:
            self.misses += 1
            return None
        query = np.asarray(tokens[:-1], dtype=np.int64)
        best_key: TokenKey | None = None
        best_len = 0
        for key, entry in self._entries.items():
            n = _common_prefix(entry.tokens, query)
            if n > best_len:
                best_key, best_len = key, n
        if best_key is None or best_len < self.min_hit_tokens:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best_key)
        held = self._entries[best_key].prefix
        prefix = SharedPrefix(held.segment_id, held.blocks[: self.store.blocks_for(best_len)], best_len)
        return PrefixHit(best_key, prefix.tokens, prefix)

    def insert(self, tokens: Sequence[int], prefix: SharedPrefix) -> None:
        """Keep `prefix` (the KV of `tokens`, a hold the caller hands over); entries that
        are a prefix of it become redundant. A hold the cache does not keep is dropped."""
        key = tuple(tokens)
        if len(key) == 0 or len(key) != prefix.tokens:
            self.store.drop_prefix(prefix)
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            self.store.drop_prefix(prefix)
            return
        arr = np.asarray(key, dtype=np.int64)
        for other_key, other in list(self._entries.items()):
            n = _common_prefix(other.tokens, arr)
            if n == len(other.tokens):
                self._drop(other_key)
            elif n == len(arr):
                self._entries.move_to_end(other_key)
                self.store.drop_prefix(prefix)
                return
        nbytes = len(prefix.blocks) * self.store.block_bytes
        if nbytes > self.max_bytes:
            self.store.drop_prefix(prefix)
            return
        self._entries[key] = _Entry(arr, prefix, nbytes)
        self._bytes += nbytes
        self._enforce_limits()

    def evictable_bytes(self, protect: frozenset[TokenKey] = frozenset()) -> int:
        """Device memory that evicting every unprotected entry would return."""
        return self.store.freeable_bytes([e.prefix for k, e in self._entries.items() if k not in protect])

    def evict(self, nbytes: int, protect: frozenset[TokenKey] = frozenset()) -> int:
        """Evict least-recently-used entries (never those in `protect`) until `nbytes` are freed."""
        freed = 0
        for key in [k for k in self._entries if k not in protect]:
            if freed >= nbytes:
                break
            pool = self.store.pool_bytes()
            self._drop(key)
            freed += pool - self.store.pool_bytes()
            self.evictions += 1
        return freed

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def keys(self) -> list[TokenKey]:
        """Entry keys, least recently used first."""
        return list(self._entries)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self._bytes, len(self._entries), self.hits, self.misses, self.evictions,
            self.max_bytes, self.max_entries,
        )

    def _drop(self, key: TokenKey) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        self.store.drop_prefix(entry.prefix)

    def _enforce_limits(self) -> None:
        while self._entries and (
            self._bytes > self.max_bytes or len(self._entries) > self.max_entries
        ):
            self._drop(next(iter(self._entries)))
            self.evictions += 1
