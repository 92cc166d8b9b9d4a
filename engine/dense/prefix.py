"""The dense path's prefix cache: snapshots of one sequence's mlx-lm caches, found again
by later prompts that extend the same tokens.

Recurrent state (`ArraysCache`) and sliding windows (`RotatingKVCache`) cannot be trimmed
back to an earlier position, and a paged block holds nothing of them, so the unit here is
a whole snapshot: a copy of every layer's cache of one sequence after exactly `n` tokens.
A snapshot serves a prompt whose first `n` tokens are those, and that has at least one
more (its last prompt token must run through the model to give the first output token);
the request resumes from a copy of it and prefills only the rest. This is what mlx-lm's
`LRUPromptCache` does for caches it cannot trim, and what vLLM does for Mamba state
(a checkpoint at block boundaries, and the longest prefix with one).

Snapshots are taken where a later prompt is likely to resume:
- at checkpoint boundaries during prefill (every `checkpoint_tokens` tokens; the runner
  ends a chunk on each boundary), so prompts sharing a long head find it. Each snapshot
  copies every layer, full-attention KV included, so one at every boundary of an N-token
  prompt would hold about N² / (2 · checkpoint_tokens) tokens of KV (a 32k prompt at 512:
  32 times its own). Kept are the boundaries k · checkpoint_tokens with k a power of two,
  and the two last before the prompt's end (where a shared system prompt or an agent's
  earlier turns end): at most about 4N tokens, and a prompt that parts from a kept one
  after d tokens resumes from at least d / 2 of them, or from the nearest boundary when
  it parts within the last two (`keeps_checkpoint`);
- at the end of the prompt, when the request starts decoding (the same prompt again);
- at the end of the request, prompt and answer (an agent's next turn sends both back).

Keys. A snapshot of `n` tokens is named by the prefix cache's chain digest
(`engine.prefix.keys`): the digest of its whole blocks' chain, then of its partial last
block after that. A lookup tries the lengths that snapshots exist at, longest first, so
it costs the prompt's block digests (kept in the request's `memo`) and one digest per
distinct length, never the number of snapshots.

Budget. Snapshots are prefix-cache bytes under the memory guard, as the paged cache's
blocks are: nothing caps them by default, admission evicts them (least recently used
first, never one a waiting request is about to resume from) before a request waits or is
refused, the once-a-second upkeep evicts them when the process is over its ceiling, and an
operator's `max_bytes` caps them. Every snapshot is its own allocation, so evicting it
returns its bytes to the device.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.kv.store import SharedPrefix
from engine.prefix.cache import CAUSES, PrefixCacheStats, PrefixHit
from engine.prefix.checkpoints import keeps_checkpoint
from engine.prefix.keys import ROOT, ChainKey, chain_digest


@dataclass(frozen=True, eq=False)
class Snapshot(SharedPrefix):
    """One sequence's caches after exactly `tokens` tokens: arrays of its own (copies,
    cut to what is written), which nothing writes into. `segment_id` and `blocks` are the
    paged hold's fields and mean nothing here."""

    caches: tuple[Any, ...] = ()
    nbytes: int = 0


def take_snapshot(caches: Seq[Any], tokens: int) -> Snapshot:
    """Copy one sequence's per-layer caches (a request's own, or rows `extract`ed from the
    batch caches). The copies are queued, not waited for."""
    copies = tuple(copy.deepcopy(list(caches)))  # new cache objects; arrays still shared
    arrays: list[mx.array] = []
    for leaf in _leaves(copies):
        _own_arrays(leaf, arrays)
    mx.async_eval(arrays)
    return Snapshot(-1, (), tokens, caches=copies, nbytes=sum(a.nbytes for a in arrays))


def restore(snapshot: Snapshot) -> list[Any]:
    """Caches to resume a sequence from: new cache objects over the snapshot's arrays
    (MLX arrays are values, and a cache's writes make new ones, so the snapshot stays
    as it was)."""
    return list(copy.deepcopy(snapshot.caches))


def _own_arrays(leaf: Any, out: list[mx.array]) -> None:
    """Replace the cache's arrays by copies of their written part (a `KVCache` allocates
    in 256-token steps; a row extracted from a batch is a view of the batch's buffer)."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    if isinstance(leaf, KVCache) and leaf.keys is not None and leaf.offset < leaf.keys.shape[2]:
        leaf.keys = leaf.keys[..., : leaf.offset, :]
        leaf.values = leaf.values[..., : leaf.offset, :]
    if isinstance(leaf, ArraysCache):
        leaf.cache = [None if a is None else mx.contiguous(a) for a in leaf.cache]
        out.extend(a for a in leaf.cache if a is not None)
    for name, value in list(vars(leaf).items()):
        if isinstance(value, mx.array):
            value = mx.contiguous(value)
            setattr(leaf, name, value)
            out.append(value)


def _leaves(caches: Seq[Any]) -> Iterator[Any]:
    from mlx_lm.models.cache import CacheList

    for c in caches:
        if isinstance(c, CacheList):
            yield from _leaves(list(c.caches))
        else:
            yield c


@dataclass(eq=False)
class _Entry:
    key: ChainKey
    snapshot: Snapshot


@dataclass
class DensePrefixCache:
    """The prefix cache of the dense path, with the paged `PrefixCache`'s interface as the
    engine uses it (lookup, insert, evict, stats)."""

    block_size: int  # the chain digests' block: the paged cache's
    checkpoint_tokens: int  # a snapshot every this many prompt tokens during prefill
    max_bytes: int | None = None  # an operator's cap; None: the memory guard governs
    min_hit_tokens: int = 1
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    evicted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    disk: None = None  # no disk tier for snapshots
    _lru: OrderedDict[ChainKey, _Entry] = field(default_factory=OrderedDict)  # least recent first
    _lengths: dict[int, int] = field(default_factory=dict)  # snapshot length -> how many
    _bytes: int = 0

    # ---- sizes -----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def evictions(self) -> int:
        return sum(self.evicted.values())

    @property
    def on(self) -> bool:
        return self.max_bytes != 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def checkpoint_at(self, start: int, end: int) -> int | None:
        """The first checkpoint boundary after `start` and before `end` (a chunk from
        `start` to `end` ends there instead), or None."""
        if not self.on or self.checkpoint_tokens <= 0:
            return None
        boundary = (start // self.checkpoint_tokens + 1) * self.checkpoint_tokens
        return boundary if boundary < end else None

    def keeps_checkpoint(self, tokens: int, prompt_len: int) -> bool:
        """Whether the boundary at `tokens` of a prompt of `prompt_len` tokens is snapshotted
        (`engine.prefix.checkpoints` says which)."""
        return self.on and keeps_checkpoint(tokens, prompt_len, self.checkpoint_tokens)

    # ---- lookup ----------------------------------------------------------------------
    def lookup(self, tokens: Seq[int], *, count: bool = True,
               memo: list[ChainKey] | None = None) -> PrefixHit | None:
        """The longest snapshot of a prefix of `tokens`, at most `len(tokens) - 1` of them.
        `count`: a lookup repeated for the same request says False; `memo` keeps the
        prompt's block digests between its lookups."""
        memo = [] if memo is None else memo
        limit = len(tokens) - 1
        for n in sorted(self._lengths, reverse=True):
            if n > limit:
                continue
            if n < self.min_hit_tokens:
                break
            entry = self._lru.get(self._key(tokens, n, memo))
            if entry is None or entry.snapshot.tokens != n:
                continue
            self._lru.move_to_end(entry.key)
            if count:
                self.hits += 1
                self.hit_tokens += n
            return PrefixHit(entry.key, n, entry.snapshot)
        self.misses += count
        return None

    def _key(self, tokens: Seq[int], n: int, memo: list[ChainKey]) -> ChainKey:
        """The chain digest of the first `n` tokens: whole blocks (kept in `memo`, as the
        paged cache keeps them), then the partial last block."""
        bs = self.block_size
        whole = n // bs
        while len(memo) < whole:
            i = len(memo)
            memo.append(chain_digest(memo[-1] if memo else ROOT, tokens[i * bs : (i + 1) * bs]))
        parent = memo[whole - 1] if whole else ROOT
        return parent if n % bs == 0 else chain_digest(parent, tokens[whole * bs : n])

    # ---- insertion -------------------------------------------------------------------
    def insert(self, tokens: Seq[int], prefix: SharedPrefix) -> None:
        """Keep `prefix` (a `Snapshot` of `tokens`); a snapshot of the same tokens already
        kept stays, and becomes the most recent."""
        if not isinstance(prefix, Snapshot) or not self.on:
            return
        if not prefix.tokens or len(tokens) != prefix.tokens:
            return
        key = self._key(tokens, prefix.tokens, [])
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        self._lru[key] = _Entry(key, prefix)
        self._lengths[prefix.tokens] = self._lengths.get(prefix.tokens, 0) + 1
        self._bytes += prefix.nbytes
        if self.max_bytes is not None and self._bytes > self.max_bytes:
            self._evict_until(self._bytes - self.max_bytes, frozenset({key}), cause="cap")

    # ---- eviction --------------------------------------------------------------------
    def evictable_bytes(self, protect: frozenset[ChainKey] = frozenset()) -> int:
        """What evicting every snapshot but the protected ones would return."""
        return self._bytes - sum(self._lru[k].snapshot.nbytes for k in protect if k in self._lru)

    def evict(self, nbytes: int, protect: frozenset[ChainKey] = frozenset(), *,
              cause: str = "admission") -> int:
        """Free at least `nbytes`, least recently used snapshots first, never a protected
        one (a waiting request resumes from it). Returns the bytes freed."""
        if nbytes <= 0:
            return 0
        return self._evict_until(nbytes, protect, cause=cause)

    def evict_lru(self, blocks: int, *, cause: str) -> int:
        """Evict the `blocks` least recently used snapshots."""
        count = 0
        while self._lru and count < blocks:
            self._remove(next(iter(self._lru)), cause)
            count += 1
        return count

    def clear(self) -> None:
        """Drop everything (no eviction counted: a failed step or the warm-up)."""
        self._lru.clear()
        self._lengths.clear()
        self._bytes = 0

    def spill(self, deadline: float | None = None) -> int:
        return 0  # no disk tier

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self._bytes, len(self._lru), self.hits, self.misses, self.hit_tokens,
            self.evictions, dict(self.evicted), self.max_bytes, None,
        )

    def _evict_until(self, nbytes: int, protect: frozenset[ChainKey], *, cause: str) -> int:
        freed = 0
        for key in [k for k in self._lru if k not in protect]:
            if freed >= nbytes:
                break
            freed += self._remove(key, cause)
        return freed

    def _remove(self, key: ChainKey, cause: str) -> int:
        entry = self._lru.pop(key)
        n = entry.snapshot.tokens
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]
        self._bytes -= entry.snapshot.nbytes
        self.evicted[cause] += 1
        return entry.snapshot.nbytes
