"""The KV store: paged blocks in segments, allocated per request, never copied per batch.

Layout. Each *segment* holds, for every layer, one keys and one values array of shape
``[blocks × block_size, kv_heads, head_dim]`` (vLLM's ``[num_blocks, block_size, heads,
dim]``, flattened to token slots). A request's *block table* lists the blocks it owns;
token ``j`` of the request lives in slot ``table[j // block_size] * block_size + j %
block_size``. All of one request's blocks sit in one segment, so one gather (or one
kernel launch) per segment serves every row that lives there. A model with sliding-window
layers is held in layer groups of equal size (`memory.paged`): a segment then holds one
array per slot of a group, a block holds one group's layers, and a request keeps one table
per group, a window group's a ring of blocks that never grows. With quantized KV
(`KVGeometry.kv_bits`) a slot holds, per head, one uint32 row of packed values with their
scales and biases (`engine.kv.quant`) instead of ``head_dim`` values of the model's dtype.

Life of a request. Admission reserves ``ceil((prompt + max_tokens) / block_size)``
blocks, in the first segment with that many free, else in a new segment. The blocks stay
put until the request ends: prefill chunks and decode tokens are written into them by
slice updates that MLX performs in place (the segment arrays are referenced only here, so
their buffers are donated), a join or a leave touches no other request's memory, and
growth never reallocates. An empty segment is dropped; segments have a fixed default size,
so MLX's buffer cache hands the same buffer back to the next one.

Prefix sharing. A prefix-cache entry holds references on the blocks of its prefix. A
request that hits it references the same full blocks (no copy), copies the few tokens of a
partly filled last block into its own first block (copy-on-write of at most one block),
and allocates the rest in the same segment; only when that segment is full is the prefix
copied once into a new one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv.blocks import BlockAllocator, consecutive
from engine.kv.buckets import KeyLengths
from engine.kv.quant import KVQuant
from memory.paged import PagedGroup, group_blocks, group_layers, ring_blocks
from memory.paged import snapshot_spare as spare_blocks

DEFAULT_BLOCK_SIZE = 16
DEFAULT_SEGMENT_BYTES = 2 << 30
MAX_SEGMENT_TOKENS = 16384
# The CPU attends segment by segment anyway (gather + SDPA per group), and its memory is
# the system's: small segments hand memory back as soon as their requests end.
CPU_SEGMENT_TOKENS = 2048
# On CUDA every segment a decode step touches costs its own launches in every layer
# (writes, a kernel, a merge, row gathers), and MLX spends host time encoding each: at
# batch 32 three 2 GiB segments made the step ~3x the bare model's (docs/throughput.md).
# So segments there are an eighth of the card, between 2 and 16 GiB: one segment holds
# 64 requests of 1k tokens on an 8B model on an H200. Admission still sizes a segment
# exactly when a default one would not fit (`KVStore.reserve(exact=True)`).
CUDA_SEGMENT_FRACTION = 8
CUDA_SEGMENT_BYTES = (2 << 30, 16 << 30)


def default_segment_tokens(backend: str, bytes_per_token: int, device_bytes: int | None = None,
                           *, groups: int = 1) -> int:
    """A new segment's size in tokens, as the engine picks it for a backend; `bytes_per_token`
    is a block's (`KVGeometry.bytes_per_token`) and `groups` how many layer groups' blocks
    hold all of a token's layers (`memory.paged`): on the CPU, a segment holds the same bytes
    whatever the grouping."""
    if backend == "cpu":
        return CPU_SEGMENT_TOKENS * groups
    if backend == "cuda" and device_bytes:
        low, high = CUDA_SEGMENT_BYTES
        return max(1, min(max(device_bytes // CUDA_SEGMENT_FRACTION, low), high) // bytes_per_token)
    return max(1, min(MAX_SEGMENT_TOKENS, DEFAULT_SEGMENT_BYTES // bytes_per_token))


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype  # the model's: what attention reads
    kv_bits: int | None = None  # quantized KV (engine.kv.quant); None: rows in `dtype`
    kv_group_size: int = 64
    # Keys each layer attends (its sliding window), None for a full layer; () when every
    # layer is full. Layers are held in groups of one kind (`memory.paged`).
    windows: tuple[int | None, ...] = ()
    # A model whose attention does its own arithmetic on what its cache returns (MLA's
    # latent keys and rotary values, of other widths than the config's heads): values of
    # `value_dim` (0: head_dim), and decode hands back each row's gathered K/V with a
    # length mask instead of attending itself (`engine.kv.cache.DecodeCache`).
    value_dim: int = 0
    gather: bool = False
    # A hybrid with recurrent state (`engine.kv.state`): for each of the model's cache
    # entries, whether it is a state entry (True) rather than one of the store's
    # `num_layers` KV layers; () when every entry is a KV layer. `state_bytes`: one
    # sequence's state, every state entry.
    states: tuple[bool, ...] = ()
    state_bytes: int = 0

    @cached_property
    def groups(self) -> tuple[PagedGroup, ...]:
        if not self.windows:
            return (PagedGroup(tuple(range(self.num_layers))),)
        return group_layers(self.windows)

    @cached_property
    def windowed(self) -> bool:
        return any(g.window is not None for g in self.groups)

    @cached_property
    def block_layers(self) -> int:
        """Layers one block holds (a segment's arrays per K and V): the largest group's."""
        return max(len(g.layers) for g in self.groups)

    @cached_property
    def layer_slots(self) -> tuple[tuple[int, int], ...]:
        """(group, slot) of each model layer: which block table it reads, which array."""
        where = {layer: (gi, slot) for gi, g in enumerate(self.groups) for slot, layer in enumerate(g.layers)}
        return tuple(where[layer] for layer in range(self.num_layers))

    @property
    def quant(self) -> KVQuant | None:
        if self.kv_bits is None:
            return None
        return KVQuant(self.kv_bits, self.kv_group_size, self.head_dim, self.dtype)

    @property
    def row_shape(self) -> tuple[tuple[int, int], mx.Dtype]:
        """One slot of a segment's layer array: (heads, row width) and the array's dtype."""
        quant = self.quant
        if quant is None:
            return (self.num_kv_heads, self.head_dim), self.dtype
        return (self.num_kv_heads, quant.row_words), mx.uint32

    @property
    def value_row_shape(self) -> tuple[tuple[int, int], mx.Dtype]:
        """The same for values: `row_shape` unless they have a width of their own."""
        if not self.value_dim or self.value_dim == self.head_dim:
            return self.row_shape
        if self.kv_bits is not None:
            raise ValueError("quantized KV needs keys and values of one width")
        return (self.num_kv_heads, self.value_dim), self.dtype

    @property
    def layer_bytes_per_token(self) -> int:
        (heads, width), dtype = self.row_shape
        (_, value_width), value_dtype = self.value_row_shape
        return heads * (width * dtype.size + value_width * value_dtype.size)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token slot of a block: every layer's where all layers are full."""
        return self.block_layers * self.layer_bytes_per_token

    @property
    def model_bytes_per_token(self) -> int:
        """Keys and values of one token in every layer (the rate as if every layer held
        every token; window layers hold at most their ring)."""
        return self.num_layers * self.layer_bytes_per_token


@dataclass(frozen=True)
class SharedPrefix:
    """The blocks of a cached prefix, in one segment: `tokens` tokens, the last block
    possibly only partly theirs."""

    segment_id: int
    blocks: tuple[int, ...]
    tokens: int
    # A model with window groups (`KVGeometry.groups`): for each of `blocks`, the window
    # groups' blocks holding the same positions (a copy of the rings, which move on), or
    # None; positions from `window_from` on are in them.
    windows: tuple[tuple[int, ...] | None, ...] = ()
    window_from: int = 0
    # A hybrid (`KVGeometry.states`): its recurrent state after exactly `tokens` tokens
    # (`engine.kv.state.Snapshot`); a prefix without one cannot be resumed.
    state: Any = None


@dataclass(frozen=True)
class KVStoreStats:
    reserved_bytes: int  # blocks held by running/prefilling requests
    used_bytes: int  # tokens those requests have written so far
    pool_bytes: int  # all segments, free blocks included
    request_bytes: int  # segments that hold requests, less their prefix-cache-only blocks
    bytes_per_token: int
    block_size: int
    segments: int
    requests: int
    # the layer groups (memory.paged): layers, window (None: full) and the blocks of a ring
    groups: tuple[dict[str, int | None], ...] = ()
    state_bytes: int = 0  # a hybrid's recurrent state per sequence (`engine.kv.state`), beside its blocks


class Segment:
    def __init__(self, segment_id: int, num_blocks: int, block_size: int, geo: KVGeometry) -> None:
        self.id = segment_id
        self.blocks = BlockAllocator(num_blocks)
        self.slots = num_blocks * block_size
        row, dtype = geo.row_shape
        value_row, value_dtype = geo.value_row_shape
        shape, value_shape = (num_blocks * block_size, *row), (num_blocks * block_size, *value_row)
        # one array per layer a block holds: a group's layer at slot s reads keys[s]
        self.keys: list[mx.array] = [mx.zeros(shape, dtype) for _ in range(geo.block_layers)]
        self.values: list[mx.array] = [mx.zeros(value_shape, value_dtype) for _ in range(geo.block_layers)]
        mx.eval(self.keys, self.values)
        self.nbytes = sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def arrays(self) -> list[mx.array]:
        return [*self.keys, *self.values]


@dataclass
class Allocation:
    """One request's place in the store."""

    request_id: str
    segment: Segment
    table: list[int]  # block ids of the first layer group, shared prefix blocks first
    length: int = 0  # tokens written
    shared: int = 0  # leading blocks shared with the prefix cache
    table_array: mx.array | None = field(default=None, repr=False)
    # The other layer groups' tables (`KVGeometry.groups`): a window group's is a ring.
    rings: tuple[list[int], ...] = ()
    blocks: int = 0  # blocks for every token of the reservation (a full group's table)

    @property
    def capacity(self) -> int:
        """Blocks for every token the request may write: its tokens' room is this × block size."""
        return self.blocks or len(self.table)

    @property
    def tables(self) -> tuple[list[int], ...]:
        return (self.table, *self.rings)

    def owned(self) -> list[int]:
        return [b for t in self.tables for b in t]


class KVStore:
    def __init__(
        self,
        geometry: KVGeometry,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        segment_tokens: int | None = None,
        key_bucket: int = 0,
        pair_flops: int = 0,
        plan_ms: float = 0.0,
        chunk_tokens: int = 512,
    ) -> None:
        self.geometry = geometry
        self.block_size = block_size
        # the most tokens one call writes for a request (a prefill chunk, a speculative
        # verify): a window group's ring holds its window plus that many (`memory.paged`)
        self.chunk_tokens = chunk_tokens
        # prefill keys padded to lengths from a small set, or exact (engine.kv.buckets)
        self.key_lengths = KeyLengths(key_bucket, pair_flops, plan_ms)
        # a prefill reads a request on one run of slots as a view of the pool; False: it
        # always gathers (`bench.chunk_cost` times both)
        self.prefill_views = True
        if segment_tokens is None:
            segment_tokens = default_segment_tokens("metal", geometry.bytes_per_token)
        self.segment_blocks = max(1, segment_tokens // block_size)
        self.block_bytes = block_size * geometry.bytes_per_token
        self.segments: dict[int, Segment] = {}
        self.requests: dict[str, Allocation] = {}

    @property
    def key_bucket(self) -> int:
        return self.key_lengths.bucket

    # ---- sizes -----------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        """Blocks of a full group's table for `tokens` tokens."""
        return -(-max(tokens, 1) // self.block_size)

    def group_blocks(self, tokens: int) -> list[int]:
        """Blocks a request of `tokens` holds in each layer group."""
        return [group_blocks(g, tokens, self.block_size, self.chunk_tokens) for g in self.geometry.groups]

    def request_blocks(self, tokens: int) -> int:
        """Blocks a request of `tokens` holds in all its groups."""
        if not self.geometry.windowed and len(self.geometry.groups) == 1:
            return self.blocks_for(tokens)
        return sum(self.group_blocks(tokens))

    def reservation_bytes(self, tokens: int) -> int:
        """What a request of `tokens` (prompt + max_tokens) reserves: whole blocks, and a
        hybrid's recurrent state (`engine.kv.state`), a fixed size."""
        return self.request_blocks(tokens) * self.block_bytes + self.geometry.state_bytes

    @property
    def batches_prefill(self) -> bool:
        """Several prompts' chunks share a prefill call, unless the model carries state."""
        return not self.geometry.states

    def rows_reservation_bytes(self, final_lens: Iterable[int]) -> int:
        """What requests of these final lengths reserve together: each its own blocks."""
        return sum(self.reservation_bytes(n) for n in final_lens)

    def growth_bytes(self, tokens: int, shared: SharedPrefix | None = None, *, exact: bool = False) -> int:
        """Bytes the device must newly give for `reserve(tokens, shared, exact=exact)`:
        zero when a segment has the free blocks, else a new segment."""
        need = self.request_blocks(tokens)
        state = self.geometry.state_bytes  # always a new allocation of its own
        if shared is not None:
            seg = self.segments.get(shared.segment_id)
            if seg is not None and seg.blocks.free >= need - shared.tokens // self.block_size:
                return state
        if self._segment_with(need + self._spare) is not None:
            return state
        return self._new_segment_blocks(need, exact) * self.block_bytes + state

    # ---- requests --------------------------------------------------------------------
    def reserve(
        self, request_id: str, tokens: int, shared: SharedPrefix | None = None, *, exact: bool = False
    ) -> Allocation:
        """Give `request_id` room for `tokens` tokens, sharing `shared`'s blocks if it can
        (they are the first group's: a model with window groups shares none)."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id} already holds KV")
        per_group = self.group_blocks(tokens)
        need, first = sum(per_group), per_group[0]
        alloc: Allocation | None = None
        if shared is not None and shared.blocks:
            seg = self.segments.get(shared.segment_id)
            full = shared.tokens // self.block_size
            # right after the prefix's last full block where it can: the row then stays one run
            after = shared.blocks[full - 1] if full else None
            own = seg.blocks.allocate(need - full, after) if seg is not None else None
            if seg is not None and own is not None:
                seg.blocks.share(list(shared.blocks[:full]))
                alloc = self._allocation(request_id, seg, [*shared.blocks[:full], *own], per_group)
                alloc.shared = full
                self._copy_prefix(shared, alloc, start=full * self.block_size)
        if alloc is None:
            seg = self._segment_with(need + self._spare) \
                or self._add_segment(self._new_segment_blocks(need, exact))
            blocks = seg.blocks.allocate(need)
            assert blocks is not None
            alloc = self._allocation(request_id, seg, blocks, per_group)
            if shared is not None and shared.blocks:
                self._copy_prefix(shared, alloc)
        alloc.blocks = self.blocks_for(tokens)
        assert len(alloc.table) == first
        if shared is not None and shared.blocks and self.geometry.windowed:
            self._copy_windows(shared, alloc)
        alloc.table_array = mx.array(alloc.table, dtype=mx.int32)
        self.requests[request_id] = alloc
        return alloc

    @staticmethod
    def _allocation(request_id: str, seg: Segment, blocks: list[int], per_group: list[int]) -> Allocation:
        """Split a reservation's blocks into its groups' tables, in group order."""
        tables, at = [], 0
        for n in per_group:
            tables.append(blocks[at : at + n])
            at += n
        return Allocation(request_id, seg, tables[0], rings=tuple(tables[1:]))

    def release(self, request_id: str) -> None:
        alloc = self.requests.pop(request_id, None)
        if alloc is None:
            return
        alloc.segment.blocks.release(alloc.owned())
        self._drop_if_empty(alloc.segment)

    def get(self, request_id: str) -> Allocation:
        return self.requests[request_id]

    def advance(self, request_id: str, tokens: int) -> None:
        alloc = self.requests[request_id]
        alloc.length += tokens
        if alloc.length > alloc.capacity * self.block_size:
            raise RuntimeError(f"request {request_id} outgrew its reservation")

    # ---- the prefix cache's holds ----------------------------------------------------
    def hold_prefix(self, request_id: str, tokens: int, *, leave_free: int = 0) -> SharedPrefix | None:
        """Take a reference on the blocks holding the request's first `tokens` tokens.

        A model with window groups also gets a copy of what a request resuming at `tokens`
        needs of its rings, the window's last positions, in new blocks of the same segment:
        the rings move on as the request decodes. None if the segment has no room for it
        with `leave_free` blocks left over."""
        alloc = self.requests[request_id]
        tokens = min(tokens, alloc.length)
        if tokens <= 0:
            return None
        blocks = alloc.table[: self.blocks_for(tokens)]
        windows: tuple[tuple[int, ...] | None, ...] = ()
        window_from = 0
        if self.geometry.windowed:
            copied = self._snapshot_windows(alloc, tokens, leave_free)
            if copied is None:
                return None
            windows, window_from = copied
        alloc.segment.blocks.share(blocks)
        return SharedPrefix(alloc.segment.id, tuple(blocks), tokens, windows, window_from)

    def _window_groups(self) -> list[tuple[int, PagedGroup]]:
        return [(gi, g) for gi, g in enumerate(self.geometry.groups) if g.window is not None]

    def window_span(self) -> int:
        """Positions before a resume point that a window layer reads: the widest window - 1."""
        return max((g.window or 1 for _, g in self._window_groups()), default=1) - 1

    def snapshot_spare(self) -> int:
        """Blocks a new segment keeps for copies of the rings at a prompt's and at a
        conversation's end: a checkpoint's copy leaves them free."""
        return spare_blocks(self.geometry.groups, self.block_size)

    def _snapshot_windows(self, alloc: Allocation, tokens: int, leave_free: int = 0
                          ) -> tuple[tuple[tuple[int, ...] | None, ...], int] | None:
        """Copy positions [tokens - window + 1, tokens) of every window group's ring into new
        blocks, one per group and block index, from a block earlier (a hit may end up to a
        block short of `tokens`) where the ring still holds them."""
        bs, groups = self.block_size, self._window_groups()
        rings = [alloc.tables[gi] for gi, _ in groups]
        held = min(len(r) for r in rings) * bs  # the ring's last positions up to alloc.length
        start = max(0, tokens - self.window_span() - (bs - 1), alloc.length - held)
        if start > max(0, tokens - self.window_span()):
            return None  # the ring moved past what a hit at `tokens` needs
        first, last = start // bs, self.blocks_for(tokens)
        if alloc.segment.blocks.free < (last - first) * len(groups) + leave_free:
            return None
        fresh = alloc.segment.blocks.allocate((last - first) * len(groups))
        assert fresh is not None  # the free blocks were counted above
        per_block = [tuple(fresh[(i - first) * len(groups) : (i - first + 1) * len(groups)])
                     for i in range(first, last)]
        pos = np.arange(start, tokens)
        dst_blocks = np.asarray(per_block, dtype=np.int64)[pos // bs - first]  # [P, groups]
        seg = alloc.segment
        for j, ((_, group), ring) in enumerate(zip(groups, rings, strict=True)):
            src = mx.array(ring_slots(ring, bs, start, tokens).astype(np.int32))
            dst = mx.array((dst_blocks[:, j] * bs + pos % bs).astype(np.int32))
            _copy_rows(seg, src, seg, dst, len(group.layers))
        mx.eval(seg.arrays())
        return (None,) * first + tuple(per_block), start

    def _copy_windows(self, shared: SharedPrefix, alloc: Allocation) -> None:
        """Fill the new request's rings with the window positions before `shared.tokens`,
        from the snapshot blocks the prefix cache holds."""
        bs, t = self.block_size, shared.tokens
        start = max(0, t - self.window_span())
        if start >= t:
            return
        pos = np.arange(start, t)
        snapshot = shared.windows
        needed = [snapshot[i] if i < len(snapshot) else None for i in range(start // bs, -(-t // bs))]
        if start < shared.window_from or any(w is None for w in needed):
            raise ValueError("a prefix hit on a model with window layers needs the window's snapshot")
        src_blocks = np.asarray(needed, dtype=np.int64)
        src_blocks = src_blocks[pos // bs - start // bs]
        src_seg, dst_seg = self.segments[shared.segment_id], alloc.segment
        for j, (gi, group) in enumerate(self._window_groups()):
            src = mx.array((src_blocks[:, j] * bs + pos % bs).astype(np.int32))
            dst = mx.array(ring_slots(alloc.tables[gi], bs, start, t).astype(np.int32))
            _copy_rows(src_seg, src, dst_seg, dst, len(group.layers))
        mx.eval(dst_seg.arrays())

    def drop_prefix(self, prefix: SharedPrefix) -> None:
        seg = self.segments.get(prefix.segment_id)
        if seg is None:
            return
        seg.blocks.release([*prefix.blocks, *(b for w in prefix.windows if w for b in w)])
        self._drop_if_empty(seg)

    # ---- accounting ------------------------------------------------------------------
    def reserved_bytes(self) -> int:
        """Blocks the requests own, and a hybrid's state for each."""
        blocks = sum(len(a.owned()) for a in self.requests.values())
        return blocks * self.block_bytes + len(self.requests) * self.geometry.state_bytes

    def pool_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments.values())

    def request_bytes(self) -> int:
        """Device memory held on behalf of requests: every segment a request lives in,
        free blocks included (they exist because of it), less the blocks only the prefix
        cache holds. With no request admitted it is zero."""
        per_seg: dict[int, set[int]] = {}
        for a in self.requests.values():
            per_seg.setdefault(a.segment.id, set()).update(a.owned())
        total = 0
        for seg_id, blocks in per_seg.items():
            seg = self.segments[seg_id]
            prefix_only = seg.blocks.used - len(blocks)
            total += seg.nbytes - prefix_only * self.block_bytes
        return total + len(self.requests) * self.geometry.state_bytes

    def freeable_bytes(self, prefixes: list[SharedPrefix]) -> int:
        """Device memory that dropping these prefix holds would return: the segments
        they would leave empty. Blocks freed inside a live segment only make room there."""
        drops: dict[int, dict[int, int]] = {}
        for p in prefixes:
            counts = drops.setdefault(p.segment_id, {})
            for b in p.blocks:
                counts[b] = counts.get(b, 0) + 1
        total = 0
        for seg_id, counts in drops.items():
            seg = self.segments.get(seg_id)
            if seg is None:
                continue
            if sum(1 for b, n in counts.items() if seg.blocks.refs(b) == n) == seg.blocks.used:
                total += seg.nbytes
        return total

    def block_arrays(self, segment_id: int, block: int) -> list[mx.array]:
        """One block's rows in every layer, as the segment holds them: each layer's keys,
        then each layer's values (the prefix cache's disk tier writes them)."""
        seg = self.segments[segment_id]
        rows = slice(block * self.block_size, (block + 1) * self.block_size)
        return [k[rows] for k in seg.keys] + [v[rows] for v in seg.values]

    def load_blocks(self, request_id: str, kv: mx.array) -> None:
        """Write whole blocks' rows, [2 × layers, n × block_size, heads, width] as
        `block_arrays` gives them block by block (each layer's keys, then values), as the
        request's next n blocks, and count their tokens written: one update per layer array
        (a slice where the blocks are consecutive, as a reservation's usually are). The
        caller evaluates the segment."""
        alloc = self.requests[request_id]
        if alloc.length % self.block_size or kv.shape[1] % self.block_size:
            raise ValueError("blocks are loaded whole, at a block boundary")
        start, tokens = alloc.length, kv.shape[1]
        first, n = start // self.block_size, tokens // self.block_size
        blocks = alloc.table[first : first + n]
        rows: slice | mx.array
        if consecutive(blocks):
            rows = slice(blocks[0] * self.block_size, (blocks[0] + n) * self.block_size)
        else:
            rows = slots_of(alloc.table, self.block_size, start + tokens, start=start)
        layers = self.geometry.block_layers
        for layer in range(layers):
            alloc.segment.keys[layer][rows] = kv[layer]
            alloc.segment.values[layer][rows] = kv[layers + layer]
        self.advance(request_id, tokens)

    def cache_only_segments(self, held: dict[int, dict[int, int]]) -> list[tuple[int, int]]:
        """(id, bytes) of the segments in which `held` (segment -> block -> holds: the prefix
        cache's) holds blocks and no request lives: dropping those holds frees them. A
        request's blocks all sit in its own segment, so nothing else can hold theirs."""
        live = {a.segment.id for a in self.requests.values()}
        return [(s, self.segments[s].nbytes) for s in held if s in self.segments and s not in live]

    def reusable_blocks(self, segment_id: int, held: dict[int, int]) -> tuple[int, int]:
        """A segment's free blocks, and how many more dropping the holds `held` (block ->
        holds) would free."""
        seg = self.segments.get(segment_id)
        if seg is None:
            return 0, 0
        return seg.blocks.free, sum(1 for b, n in held.items() if seg.blocks.refs(b) == n)

    def free_blocks(self, segment_id: int) -> int:
        seg = self.segments.get(segment_id)
        return 0 if seg is None else seg.blocks.free

    def stats(self) -> KVStoreStats:
        reserved = self.reserved_bytes()
        used = sum(self._written_slots(a) for a in self.requests.values()) * self.geometry.bytes_per_token
        pool = sum(s.nbytes for s in self.segments.values())
        return KVStoreStats(
            reserved_bytes=reserved,
            used_bytes=used,
            pool_bytes=pool,
            request_bytes=self.request_bytes(),
            bytes_per_token=self.geometry.model_bytes_per_token,
            block_size=self.block_size,
            segments=len(self.segments),
            requests=len(self.requests),
            groups=self._group_report,
            state_bytes=self.geometry.state_bytes,
        )

    @cached_property
    def _group_report(self) -> tuple[dict[str, int | None], ...]:
        return tuple(
            {"layers": len(g.layers), "window": g.window,
             "ring_blocks": None if g.window is None
             else ring_blocks(g.window, self.chunk_tokens, self.block_size)}
            for g in self.geometry.groups
        )

    # ---- internals -------------------------------------------------------------------
    def _written_slots(self, alloc: Allocation) -> int:
        """Token slots of a block's width the request has written, over its groups (a ring
        holds at most its own slots)."""
        if len(self.geometry.groups) == 1 and not self.geometry.windowed:
            return alloc.length
        return sum(min(alloc.length, len(t) * self.block_size) for t in alloc.tables)

    def _segment_with(self, need: int) -> Segment | None:
        for seg in sorted(self.segments.values(), key=lambda s: s.id):
            if seg.blocks.free >= need:
                return seg
        return None

    @cached_property
    def _spare(self) -> int:
        """Free blocks a segment must keep beside a new request's for copies of its rings
        (window groups), or its prompt's end could not be cached in it. A request resuming
        from a hit takes its blocks beside the hit's, whose copies are cached already."""
        return self.snapshot_spare() if self.geometry.windowed else 0

    def _new_segment_blocks(self, need: int, exact: bool) -> int:
        """A new segment for a request of `need` blocks; with window groups, room beside it
        for copies of its rings (`memory.paged.SNAPSHOTS_PER_SEGMENT`), which the prefix
        cache takes from its segment."""
        if self.geometry.windowed:
            need += self.snapshot_spare()
        return need if exact else max(need, self.segment_blocks)

    def _add_segment(self, blocks: int) -> Segment:
        seg_id = next(i for i in range(len(self.segments) + 1) if i not in self.segments)
        seg = Segment(seg_id, blocks, self.block_size, self.geometry)
        self.segments[seg_id] = seg
        return seg

    def _drop_if_empty(self, seg: Segment) -> None:
        if seg.blocks.used == 0 and self.segments.get(seg.id) is seg:
            del self.segments[seg.id]

    def _copy_prefix(self, shared: SharedPrefix, alloc: Allocation, start: int = 0) -> None:
        """Copy prefix tokens [start, shared.tokens) into the request's own blocks: the
        partly filled last block of a hit, or the whole prefix when its segment is full."""
        alloc.length = shared.tokens
        if start >= shared.tokens:
            return
        src_seg = self.segments[shared.segment_id]
        src = slots_of(list(shared.blocks), self.block_size, shared.tokens, start=start)
        dst = slots_of(alloc.table, self.block_size, shared.tokens, start=start)
        dst_seg = alloc.segment
        _copy_rows(src_seg, src, dst_seg, dst, self.geometry.block_layers)
        mx.eval(dst_seg.arrays())


def ring_slots(ring: Iterable[int], block_size: int, start: int, end: int) -> np.ndarray:
    """Pool slots of positions [start, end) in a ring of blocks: position p lives in block
    `ring[(p // block_size) % len(ring)]` (a full table is a ring that never wraps)."""
    table = np.asarray(list(ring), dtype=np.int64)
    pos = np.arange(start, end)
    return table[(pos // block_size) % len(table)] * block_size + pos % block_size


def slots_of(table: list[int], block_size: int, tokens: int, start: int = 0) -> mx.array:
    """Pool slots of token positions [start, tokens) of a request with block table `table`."""
    return mx.array(ring_slots(table, block_size, start, tokens).astype(np.int32))


def _copy_rows(src: Segment, src_slots: mx.array, dst: Segment, dst_slots: mx.array, layers: int) -> None:
    """Copy the K/V rows of `src_slots` to `dst_slots` in the first `layers` arrays."""
    for layer in range(layers):
        dst.keys[layer][dst_slots] = src.keys[layer][src_slots]
        dst.values[layer][dst_slots] = src.values[layer][src_slots]
