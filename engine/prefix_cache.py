"""A prefix (KV) cache with byte accounting, LRU eviction and protected entries.

Entries hold the KV arrays of a prompt's prefix, keyed by its token ids. An MLX array
object is updated in place by slice assignment (`KVCache.update_and_fetch` does that), so
an entry and a request must never hold the same array *object*: both sides get their own
slice views. Views share the buffer until the request writes, when MLX copies it because
the entry still holds a reference. A hit therefore costs nothing until the request grows
its cache, and an entry can be evicted while a request that hit it is still running.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

LayerState = tuple[mx.array, mx.array, int]
TokenKey = tuple[int, ...]


@dataclass(frozen=True)
class PrefixHit:
    key: TokenKey
    cached_tokens: int
    caches: list[KVCache]


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
    layers: list[LayerState]
    nbytes: int


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    def __init__(self, *, max_bytes: int, max_entries: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
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
        if best_key is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best_key)
        caches = []
        for keys, values, _ in self._entries[best_key].layers:
            c = KVCache()
            c.keys, c.values = keys[..., :best_len, :], values[..., :best_len, :]
            c.offset = best_len
            caches.append(c)
        return PrefixHit(best_key, best_len, caches)

    def insert(self, tokens: Sequence[int], caches: Sequence[KVCache]) -> None:
        """Store the KV of `tokens`; entries that are a prefix of it become redundant."""
        if len(tokens) == 0 or any(c.keys is None for c in caches):
            return
        key = tuple(tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        arr = np.asarray(key, dtype=np.int64)
        for other_key, other in list(self._entries.items()):
            n = _common_prefix(other.tokens, arr)
            if n == len(other.tokens):
                self._drop(other_key)
            elif n == len(arr):
                self._entries.move_to_end(other_key)
                return
        layers = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset) for c in caches]
        nbytes = sum(c.nbytes for c in caches)  # the views keep the whole buffers alive
        if nbytes > self.max_bytes:
            return
        self._entries[key] = _Entry(arr, layers, nbytes)
        self._bytes += nbytes
        self._enforce_limits()

    def evictable_bytes(self, protect: frozenset[TokenKey] = frozenset()) -> int:
        return sum(e.nbytes for k, e in self._entries.items() if k not in protect)

    def evict(self, nbytes: int, protect: frozenset[TokenKey] = frozenset()) -> int:
        """Evict least-recently-used entries (never those in `protect`) until `nbytes` are freed."""
        freed = 0
        for key in [k for k in self._entries if k not in protect]:
            if freed >= nbytes:
                break
            freed += self._entries[key].nbytes
            self._drop(key)
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

    def _enforce_limits(self) -> None:
        while self._entries and (
            self._bytes > self.max_bytes or len(self._entries) > self.max_entries
        ):
            self._drop(next(iter(self._entries)))
            self.evictions += 1
