"""The prefix cache: the KV store's blocks indexed by the hash of their block chain.

Each cached block is a node keyed by ``digest(parent's digest, the block's tokens)``
(vLLM's automatic prefix caching), so a node names its whole prefix, and a lookup walks
the prompt block by block through dictionaries: it costs the prompt's length, never the
number of cached conversations. A node holds one reference on its block of the store; a
request that hits references the same full blocks (no copy), and copies the few tokens
of a partly filled last block (copy-on-write of at most one block). A partly filled
block is cached too, as a leaf: a prompt that ends mid-block, or a conversation's last
turn, is found whole.

Budget. By default there is no byte or entry cap: cached blocks live in the store's
segments, which admission let grow under the memory ceiling, and admission takes them
back when a request needs the memory (`evict`, `evict_in_segment`), least recently used
first. An operator may still set `max_bytes`.

Recency. `_lru` lists the nodes least recently used first, and a node always comes
before its parent: a hit or an insertion moves its chain to the end leaf first, root
last. Evicting from the front therefore removes leaves, so a conversation loses its
last turns before the system prompt it shares with others ("a prefix of a prefix").
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.kv.store import SharedPrefix
from engine.prefix.keys import ROOT, ChainKey, chain_digest

if TYPE_CHECKING:
    import mlx.core as mx

    from engine.prefix.disk import DiskTier

# Why an entry left memory.
CAUSES = ("admission", "ceiling", "cap")

# How long one eviction may spend writing its blocks to the disk tier, on the engine thread:
# the rest of them are dropped (least recently used first are written, so the ones kept on
# disk are the likeliest to come back).
EVICT_WRITE_S = 0.5


class BlockStore(Protocol):
    """What the cache needs of the KV store (the dense store answers with no holds)."""

    block_size: int
    block_bytes: int

    def drop_prefix(self, prefix: SharedPrefix) -> None: ...
    def pool_bytes(self) -> int: ...
    def block_arrays(self, segment_id: int, block: int) -> list[mx.array]: ...


@dataclass(frozen=True)
class PrefixHit:
    key: ChainKey  # the deepest cached node in memory the hit uses (ROOT: none)
    cached_tokens: int  # in memory and on disk
    prefix: SharedPrefix | None  # the blocks in memory
    # Full blocks read back from the disk tier after those: (key, parent key, tokens) each.
    disk: tuple[tuple[ChainKey, ChainKey, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class PrefixCacheStats:
    bytes: int
    entries: int  # cached blocks
    hits: int
    misses: int
    hit_tokens: int
    evictions: int  # blocks evicted, all causes
    evictions_by_cause: dict[str, int]
    max_bytes: int | None  # an operator's cap; None: the memory guard governs
    disk: dict[str, float] | None = None  # the disk tier's figures (engine.prefix.disk)


@dataclass(eq=False)
class _Node:
    key: ChainKey
    parent: _Node | None
    tokens: tuple[int, ...]
    segment_id: int
    block: int
    end: int  # tokens from the start of the chain through this block
    children: _Children = field(default_factory=lambda: _Children())
    # A model with window layers: the window groups' blocks for this block's positions (a
    # snapshot of the rings, `KVStore.hold_prefix`), valid from position `window_from` on.
    windows: tuple[int, ...] | None = None
    window_from: int = 0
    # A hybrid (`KVGeometry.states`): its recurrent state after this node's last token
    # (`engine.kv.state`); a hit may end only at a node that has one. `state_partials`:
    # children of less than a block that hold one (a lookup looks among them only then).
    state: Any = None
    state_partials: int = 0

    def chain(self) -> list[_Node]:
        """Root first."""
        out: list[_Node] = []
        node: _Node | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


def _common(a: Seq[int], b: Seq[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _Children:
    """A node's children (or the roots): by key, by tokens, and in the order of their tokens.

    The order bounds the partial-block fallback: the child sharing the longest run of
    leading tokens with a prompt's next block sorts next to where that block would go (a
    sorted list's neighbours share the longest prefixes), so a lookup bisects instead of
    comparing the block with every child, and a first-block miss costs a bisection of the
    roots, not a comparison per cached conversation (`_walk`; `insert` likewise)."""

    __slots__ = ("_by_key", "_by_tokens", "_sorted")

    def __init__(self) -> None:
        self._by_key: dict[ChainKey, _Node] = {}
        self._by_tokens: dict[tuple[int, ...], _Node] = {}  # one child per block of tokens
        self._sorted: list[tuple[int, ...]] = []

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: ChainKey) -> _Node | None:
        return self._by_key.get(key)

    def values(self) -> list[_Node]:
        """A copy: callers remove children as they go."""
        return list(self._by_key.values())

    def add(self, node: _Node) -> None:
        self._by_key[node.key] = node
        self._by_tokens[node.tokens] = node
        bisect.insort(self._sorted, node.tokens)

    def remove(self, node: _Node) -> None:
        if self._by_key.pop(node.key, None) is None:
            return
        del self._by_tokens[node.tokens]
        del self._sorted[bisect.bisect_left(self._sorted, node.tokens)]

    def longest_common(self, rest: tuple[int, ...],
                       accept: Callable[[_Node], bool]) -> tuple[_Node | None, int]:
        """The accepted child sharing the most leading tokens with `rest`, and how many.
        From `rest`'s place in the order outwards, both ways: the shared run only shrinks
        with distance, so a side stops at the first child that cannot beat the best (only
        children refused by `accept`, of another segment, are stepped over)."""
        at = bisect.bisect_left(self._sorted, rest)
        best, best_n = None, 0
        for side in (range(at - 1, -1, -1), range(at, len(self._sorted))):
            for i in side:
                n = _common(self._sorted[i], rest)
                if n <= best_n:
                    break
                node = self._by_tokens[self._sorted[i]]
                if accept(node):
                    best, best_n = node, n
        return best, best_n

    def starting_with(self, piece: tuple[int, ...]) -> bool:
        """Does a child's block begin with `piece`? Such blocks sort right after `piece`."""
        at = bisect.bisect_left(self._sorted, piece)
        return at < len(self._sorted) and self._sorted[at][: len(piece)] == piece

    def exact(self, piece: tuple[int, ...]) -> _Node | None:
        """The child whose block is exactly `piece`."""
        return self._by_tokens.get(piece)

    def prefixes_of(self, piece: tuple[int, ...]) -> list[_Node]:
        """The children whose blocks are shorter than `piece` and begin it."""
        return [n for size in range(1, len(piece)) if (n := self._by_tokens.get(piece[:size])) is not None]


class PrefixCache:
    def __init__(self, store: BlockStore, *, max_bytes: int | None = None, min_hit_tokens: int = 1) -> None:
        self.store = store
        self.block_size = store.block_size
        self.max_bytes = max_bytes
        # A shorter shared prefix is a miss. The engine passes a block: below that a hit
        # saves nothing (a chat template's first few tokens) yet costs a copy-on-write of
        # the block and moves the prompt's chunks off offset 0, where batched prefill rows
        # keep the fused causal path.
        self.min_hit_tokens = max(min_hit_tokens, 1)
        self._roots = _Children()
        self._lru: OrderedDict[ChainKey, _Node] = OrderedDict()  # least recent first, children before parents
        self._by_segment: dict[int, dict[int, int]] = {}  # segment -> block -> the cache's holds
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0
        self.evicted: dict[str, int] = dict.fromkeys(CAUSES, 0)
        # Where evicted full blocks go, and how fast the engine prefills (is reading faster?).
        self.disk: DiskTier | None = None
        self.prefill_rate: Callable[[], float | None] = lambda: None  # tokens/s, for the stats
        # Seconds to prefill (context, tokens): the tokens after `context` cached ones. The
        # engine gives its fitted cost line, since attention makes a block deep in a long
        # prompt dearer than the average; by default, the average rate.
        self.prefill_seconds: Callable[[int, int], float | None] = self._seconds_at_average_rate
        self._write_until = 0.0  # time.monotonic() past which evicted blocks are not written
        self.unwritten = 0  # full blocks evicted without being written, for want of time
        # A model with window layers: positions before a hit that its window layers read.
        # A hit may end only where snapshots of them are cached (`_window_end`).
        geometry = getattr(store, "geometry", None)
        self.window_span: int | None = store.window_span() if getattr(geometry, "windowed", False) else None
        self._window_blocks = 0
        # A hybrid's nodes carry recurrent state: a hit ends where one does (`_state_hit`).
        self.states = bool(getattr(geometry, "states", ()))
        self.state_bytes = getattr(geometry, "state_bytes", 0) if self.states else 0
        self._states = 0  # nodes holding a state
        self._root_state_partials = 0  # roots of less than a block that hold one

    # ---- sizes -----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        blocks = len(self._lru) + self._window_blocks
        return blocks * self.store.block_bytes + self._states * self.state_bytes

    @property
    def evictions(self) -> int:
        return sum(self.evicted.values())

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    # ---- lookup ----------------------------------------------------------------------
    def lookup(self, tokens: Seq[int], *, count: bool = True,
               memo: list[ChainKey] | None = None) -> PrefixHit | None:
        """The longest cached prefix of `tokens`, at most `len(tokens) - 1` of them (the last
        prompt token must run through the model to give the first output token), in one
        segment of the store. `count`: a lookup repeated for the same request says False;
        `memo` keeps the prompt's block digests between its lookups."""
        hit = self._walk(tokens, [] if memo is None else memo)
        if hit is None or hit.cached_tokens < self.min_hit_tokens:
            self.misses += count
            return None
        if count:
            self.hits += 1
            self.hit_tokens += hit.cached_tokens
        if hit.key in self._lru:
            self._touch(self._lru[hit.key])
        return hit

    def _walk(self, tokens: Seq[int], memo: list[ChainKey]) -> PrefixHit | None:
        bs = self.block_size
        query = tuple(tokens[: max(len(tokens) - 1, 0)])
        children = self._roots
        chain: list[_Node] = []
        key = ROOT
        for i, start in enumerate(range(0, len(query) - bs + 1, bs)):
            if i == len(memo):
                memo.append(chain_digest(key, query[start : start + bs]))
            node = children.get(memo[i])
            if node is None or (chain and node.segment_id != chain[0].segment_id):
                break
            chain.append(node)
            key, children = node.key, node.children
        matched = len(chain) * bs
        rest = query[matched : matched + bs]
        best, best_n = None, 0
        # A child can share at most the block's tokens but one (all of them: the walk took
        # it), so below the minimum hit the partial block is not looked for.
        if matched + min(len(rest), bs - 1) >= self.min_hit_tokens:
            segment = chain[0].segment_id if chain else None
            best, best_n = children.longest_common(
                rest, lambda c: segment is None or c.segment_id == segment)
        disk = self._on_disk(query, len(chain), memo)
        if disk:
            best, best_n = None, 0  # the disk's full blocks go further than a partial one
        if best is not None:
            chain.append(best)
        if not chain and not disk:
            return None
        total = matched + best_n + len(disk) * bs
        if self.states:
            return self._state_hit(chain[: len(chain) - (best is not None)], query)
        if self.window_span is not None:
            total = self._window_end(chain, total)
            if total <= 0:
                return None
            chain = chain[: -(-total // bs)]
            # each node checked for its own positions (`_window_end`): the copies hold all
            # the positions from the window's start before `total` on
            prefix = SharedPrefix(chain[0].segment_id, tuple(n.block for n in chain), total,
                                  tuple(n.windows for n in chain), max(0, total - (self.window_span or 0)))
            return PrefixHit(chain[-1].key, total, prefix)
        prefix = SharedPrefix(chain[0].segment_id, tuple(n.block for n in chain), matched + best_n) \
            if chain else None
        return PrefixHit(chain[-1].key if chain else ROOT, total, prefix, disk)

    def _state_hit(self, chain: list[_Node], query: tuple[int, ...]) -> PrefixHit | None:
        """On a hybrid, the furthest point of the walk where a recurrent state is cached:
        from the deepest full block of `chain` back, a node of less than a block that the
        query's next block begins with (an earlier prompt's or conversation's end), else
        the node itself."""
        bs = self.block_size
        for depth in range(len(chain), -1, -1):
            parent = chain[depth - 1] if depth else None
            if parent.state_partials if parent is not None else self._root_state_partials:
                children = parent.children if parent is not None else self._roots
                block = query[depth * bs : (depth + 1) * bs]
                for k in range(min(len(block), bs - 1), 0, -1):
                    node = children.exact(block[:k])
                    if node is not None and node.state is not None and (
                            not depth or node.segment_id == chain[0].segment_id):
                        return self._state_prefix([*chain[:depth], node])
            if parent is not None and parent.state is not None:
                return self._state_prefix(chain[:depth])
        return None

    def _state_prefix(self, chain: list[_Node]) -> PrefixHit:
        last = chain[-1]
        prefix = SharedPrefix(chain[0].segment_id, tuple(n.block for n in chain), last.end, state=last.state)
        return PrefixHit(last.key, last.end, prefix)

    def _window_end(self, chain: list[_Node], total: int) -> int:
        """The furthest end, at most `total`, at which a request can resume on a model with
        window layers: the nodes holding the `window_span` positions before it all carry
        snapshots that reach back that far. 0: none."""
        bs, span = self.block_size, self.window_span or 0
        for i in range(len(chain) - 1, -1, -1):
            end = min(chain[i].end, total)
            start = max(0, end - span)
            needed = chain[start // bs : i + 1]
            if all(n.windows is not None and n.window_from <= max(start, n.end - len(n.tokens))
                   for n in needed):
                return end
        return 0

    def _on_disk(self, query: tuple[int, ...], blocks: int,
                 memo: list[ChainKey]) -> tuple[tuple[ChainKey, ChainKey, tuple[int, ...]], ...]:
        """The full blocks after the first `blocks` that the disk tier holds in a row, when
        reading them is faster than prefilling them."""
        disk, bs = self.disk, self.block_size
        if disk is None:
            return ()
        out = []
        parent = memo[blocks - 1] if blocks else ROOT
        for i in range(blocks, len(query) // bs):
            if i == len(memo):
                memo.append(chain_digest(parent, query[i * bs : (i + 1) * bs]))
            if memo[i] not in disk:
                break
            out.append((memo[i], parent, query[i * bs : (i + 1) * bs]))
            parent = memo[i]
        prefill_s = self.prefill_seconds(blocks * bs, len(out) * bs) if out else None
        return tuple(out) if disk.worth_reading(len(out), prefill_s) else ()

    def _seconds_at_average_rate(self, context: int, tokens: int) -> float | None:
        rate = self.prefill_rate()
        return tokens / rate if rate else None

    # ---- insertion -------------------------------------------------------------------
    def insert(self, tokens: Seq[int], prefix: SharedPrefix) -> None:
        """Cache the blocks of `prefix` (the KV of `tokens`: a hold on each block, which the
        cache takes over). Blocks already cached keep theirs and the new hold is dropped;
        a partly filled block that a new block extends is replaced by it."""
        bs = self.block_size
        tokens = tuple(tokens)
        if len(tokens) != prefix.tokens or not prefix.blocks or self.max_bytes == 0:
            self.store.drop_prefix(prefix)
            return
        seg = prefix.segment_id
        parent: _Node | None = None
        children = self._roots
        added: list[_Node] = []
        surplus: list[int] = []  # holds the cache already has
        windows = prefix.windows
        for i, block in enumerate(prefix.blocks):
            piece = tokens[i * bs : (i + 1) * bs]
            key = chain_digest(parent.key if parent else ROOT, piece)
            node = children.get(key)
            snapshot = windows[i] if i < len(windows) else None
            if node is not None and node.segment_id != seg and i < len(prefix.blocks) - 1:
                # The chain goes on in the request's segment: move the node there, so that a
                # hit on the whole chain lends blocks of one segment.
                state = node.state  # not in a segment: it stays with the node
                self._release(node)  # its snapshot too: one lives in its node's segment
                node.segment_id, node.block = seg, block
                self._hold(node)
                if state is not None:
                    node.state = state
                    self._count_state(node, 1)
                self._adopt_windows(node, snapshot, prefix.window_from, surplus)
            elif node is not None:
                surplus.append(block)
                self._adopt_windows(node, snapshot, prefix.window_from, surplus)
            elif len(piece) < bs and children.starting_with(piece) and prefix.state is None:
                surplus.append(block)  # a cached block already holds these tokens
                surplus.extend(b for w in windows[i:] if w for b in w)
                break
            else:
                for sibling in [c for c in children.prefixes_of(piece)
                                if not len(c.children) and c.state is None]:
                    self._remove(sibling)  # a partial block this one extends (a state stays)
                node = _Node(key, parent, piece, seg, block, i * bs + len(piece))
                children.add(node)
                self._hold(node)
                self._adopt_windows(node, snapshot, prefix.window_from, surplus)
                added.append(node)
            parent, children = node, node.children
        if surplus:
            self.store.drop_prefix(SharedPrefix(seg, tuple(surplus), 0))
        if parent is not None and prefix.state is not None and parent.end == prefix.tokens:
            if parent.state is None:
                self._count_state(parent, 1)
            parent.state = prefix.state  # the newer snapshot of the same tokens' state
        if parent is not None:
            for node in added:
                self._lru[node.key] = node
            self._touch(parent)
        self._enforce_cap()

    def _adopt_windows(self, node: _Node, snapshot: tuple[int, ...] | None, window_from: int,
                       surplus: list[int]) -> None:
        """Give `node` the snapshot blocks, where they reach further back than its own (the
        blocks not kept go to `surplus`, to be dropped)."""
        if snapshot is None:
            return
        start = node.end - len(node.tokens)
        if node.windows is not None and node.window_from <= max(window_from, start):
            surplus.extend(snapshot)
            return
        self._release_windows(node)
        node.windows, node.window_from = snapshot, window_from
        self._count(node.segment_id, snapshot, 1)
        self._window_blocks += len(snapshot)

    def _release_windows(self, node: _Node) -> None:
        if node.windows is None:
            return
        self._count(node.segment_id, node.windows, -1)
        self.store.drop_prefix(SharedPrefix(node.segment_id, node.windows, 0))
        self._window_blocks -= len(node.windows)
        node.windows = None

    # ---- eviction --------------------------------------------------------------------
    def evictable_bytes(self, protect: frozenset[ChainKey] = frozenset()) -> int:
        """Device memory that evicting every unprotected block would return: the segments
        that only the cache holds. Blocks freed inside a live segment only make room there
        (`room_in_segment`, `evict_in_segment`)."""
        pinned = self._pinned_segments(protect)
        whole = {sid: n for sid, n in self._cache_only_segments() if sid not in pinned}
        return sum(whole.values()) + self.state_bytes * len(self._loose_states(protect, set(whole)))

    def _loose_states(self, protect: frozenset[ChainKey], going: set[int]) -> list[_Node]:
        """A hybrid's unprotected nodes holding a state in segments that do not go whole
        (their state is an allocation of its own), in eviction order (a chain's leaves first)."""
        if not self.states:
            return []
        pinned = self._pinned_keys(protect)
        return [n for n in self._lru.values()
                if n.state is not None and n.key not in pinned and n.segment_id not in going]

    def evict(self, nbytes: int, protect: frozenset[ChainKey] = frozenset(), *,
              cause: str = "admission") -> int:
        """Free `nbytes` of device memory: the least recently used segments that only the
        cache holds (never one holding a protected chain) go whole. Returns
        the bytes freed."""
        if nbytes <= 0:
            return 0
        self._write_until = time.monotonic() + EVICT_WRITE_S
        pinned = self._pinned_segments(protect)
        candidates = {sid for sid, _ in self._cache_only_segments() if sid not in pinned}
        order: list[int] = []  # by most recent use, least recent first
        for node in reversed(self._lru.values()):
            if node.segment_id in candidates and node.segment_id not in order:
                order.append(node.segment_id)
        freed = 0
        for sid in reversed(order):
            if freed >= nbytes:
                break
            before = self.store.pool_bytes()
            # The whole segment goes: from its chains' heads, which are written first.
            for node in [n for n in reversed(self._lru.values()) if n.segment_id == sid]:
                if node.key in self._lru:
                    self._evict_subtree(node, cause)
            freed += before - self.store.pool_bytes()
        for node in self._loose_states(protect, set()) if freed < nbytes else []:
            if freed >= nbytes:
                break
            self._release_state(node)  # its blocks stay, found again only up to an earlier state
            freed += self.state_bytes
        return freed

    def room_in_segment(self, blocks: int, protect: frozenset[ChainKey] = frozenset(),
                        only: int | None = None) -> int | None:
        """A segment (`only` that one) where `blocks` blocks would be free once unprotected
        cached blocks are evicted there (the one with the most free already), or None."""
        reusable = getattr(self.store, "reusable_blocks", None)
        if reusable is None:
            return None
        pinned = self._pinned_keys(protect)
        best: tuple[int, int] | None = None
        for sid, held in self._by_segment.items():
            if only is not None and sid != only:
                continue
            keep = {self._lru[k].block for k in pinned if self._lru[k].segment_id == sid}
            free, could = reusable(sid, {b: n for b, n in held.items() if b not in keep})
            if free + could >= blocks and (best is None or free > best[1]):
                best = (sid, free)
        return None if best is None else best[0]

    def evict_in_segment(self, segment_id: int, enough: Callable[[], bool],
                         protect: frozenset[ChainKey] = frozenset()) -> int:
        """Evict the segment's least recently used blocks, leaves first, until `enough()`.
        Returns the blocks evicted."""
        pinned = self._pinned_keys(protect)
        count = 0
        self._write_until = time.monotonic() + EVICT_WRITE_S
        for node in [n for n in self._lru.values() if n.segment_id == segment_id]:
            if enough():
                break
            if node.key in self._lru and node.key not in pinned:
                count += self._evict_subtree(node, "admission")
        return count

    def evict_lru(self, blocks: int, *, cause: str) -> int:
        """Evict the least recently used `blocks` blocks, leaves first, wherever they are."""
        count = 0
        self._write_until = time.monotonic() + EVICT_WRITE_S
        while self._lru and count < blocks:
            count += self._evict_subtree(next(iter(self._lru.values())), cause)
        return count

    def clear(self) -> None:
        """Drop everything (no eviction counted: a failed step or the warm-up)."""
        for node in list(self._lru.values()):
            if node.key in self._lru:
                self._remove_subtree(node)

    def spill(self, deadline: float | None = None) -> int:
        """Write the full blocks still in memory to the disk tier until `deadline`
        (time.monotonic()), as many as the tier holds: the most recently used chains first,
        each block after the block it extends, since a lookup after a restart walks from a
        prompt's first block and a block without its parent is never reached. The files then
        take the cache's recency order, so the tier's cap drops the least recently used
        leaves first. Returns the blocks written."""
        if self.disk is None:
            return 0
        before = self.disk.written
        self._write_until = float("inf") if deadline is None else deadline
        room = self.disk.max_bytes // max(self.disk.block_bytes, 1)
        for node in reversed(self._lru.values()):  # parents before children (see `_lru`)
            if room <= 0:
                break
            self._to_disk(node)
            room -= 1
        for node in self._lru.values():
            self.disk.freshen(node.key)
        return self.disk.written - before

    def stats(self) -> PrefixCacheStats:
        disk = None
        if self.disk is not None:
            disk = {k: v for k, v in vars(self.disk.stats(self.prefill_rate())).items() if v is not None}
            disk["unwritten"] = self.unwritten
        return PrefixCacheStats(
            self.nbytes, len(self._lru), self.hits, self.misses, self.hit_tokens,
            self.evictions, dict(self.evicted), self.max_bytes, disk,
        )

    # ---- internals -------------------------------------------------------------------
    def _touch(self, node: _Node) -> None:
        """Most recently used: the chain moves to the end, leaf first, root last."""
        n: _Node | None = node
        while n is not None:
            self._lru.move_to_end(n.key)
            n = n.parent

    def _pinned_keys(self, protect: frozenset[ChainKey]) -> set[ChainKey]:
        out: set[ChainKey] = set()
        for key in protect:
            node = self._lru.get(key)
            while node is not None and node.key not in out:
                out.add(node.key)
                node = node.parent
        return out

    def _pinned_segments(self, protect: frozenset[ChainKey]) -> set[int]:
        return {self._lru[k].segment_id for k in self._pinned_keys(protect)}

    def _evict_subtree(self, node: _Node, cause: str) -> int:
        nodes = _subtree(node)
        # Each written before its children, so writes cut short by their time leave a
        # chain's head, which a later lookup can use; then made newer than them on disk, so
        # the tier's cap drops the leaves first.
        for n in nodes:
            self._to_disk(n)
        for n in reversed(nodes):
            if self.disk is not None:
                self.disk.freshen(n.key)
            self._remove(n)
            self.evicted[cause] += 1
        return len(nodes)

    def _to_disk(self, node: _Node) -> None:
        if self.disk is not None and len(node.tokens) == self.block_size and node.key not in self.disk:
            if time.monotonic() > self._write_until:
                self.unwritten += 1
                return
            arrays = self.store.block_arrays(node.segment_id, node.block)
            self.disk.write(node.key, node.parent.key if node.parent else ROOT, node.tokens, arrays)

    def _remove_subtree(self, node: _Node) -> None:
        for n in reversed(_subtree(node)):
            self._remove(n)

    def _remove(self, node: _Node) -> None:
        siblings = node.parent.children if node.parent is not None else self._roots
        siblings.remove(node)
        self._lru.pop(node.key, None)
        self._release(node)

    def _release_state(self, node: _Node) -> None:
        if node.state is not None:
            node.state = None
            self._count_state(node, -1)

    def _count_state(self, node: _Node, by: int) -> None:
        self._states += by
        if len(node.tokens) < self.block_size:
            if node.parent is not None:
                node.parent.state_partials += by
            else:
                self._root_state_partials += by

    def _hold(self, node: _Node) -> None:
        self._count(node.segment_id, (node.block,), 1)

    def _release(self, node: _Node) -> None:
        self._release_windows(node)
        self._release_state(node)
        self._count(node.segment_id, (node.block,), -1)
        self.store.drop_prefix(SharedPrefix(node.segment_id, (node.block,), 0))

    def _count(self, segment_id: int, blocks: Seq[int], by: int) -> None:
        """Add `by` to the cache's holds on `blocks` of a segment (`_by_segment`)."""
        held = self._by_segment.setdefault(segment_id, {})
        for b in blocks:
            held[b] = held.get(b, 0) + by
            if not held[b]:
                del held[b]
        if not held:
            del self._by_segment[segment_id]

    def _cache_only_segments(self) -> list[tuple[int, int]]:
        only = getattr(self.store, "cache_only_segments", None)
        return [] if only is None else only(self._by_segment)

    def _enforce_cap(self) -> None:
        if self.max_bytes is None:
            return
        over = self.nbytes - self.max_bytes
        if over > 0:
            self.evict_lru(-(-over // self.store.block_bytes), cause="cap")


def _subtree(node: _Node) -> list[_Node]:
    """The node and everything under it, each after its parent. A loop, not recursion: a
    chain is a prompt's blocks, thousands deep (a 100k-token prompt is 6,250)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out
