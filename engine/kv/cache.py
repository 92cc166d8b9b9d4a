"""The cache objects mlx-lm's model code sees: one per layer, views onto the KV store.

mlx-lm's attention does, per layer: ``rope(q, offset=cache.offset)``, ``keys, values =
cache.update_and_fetch(k, v)``, then ``scaled_dot_product_attention(q, keys, values,
cache=cache, ...)``. These objects keep that contract:

- `PrefillCache` (one request, a chunk of T tokens): writes the chunk into the request's
  blocks and returns that request's own K/V in SDPA's [1, H, L, D] layout, so the model's
  ordinary (fused where available) causal attention runs on it: a strided view of the pool
  where its blocks up to the chunk's end are one run of ids (a reservation takes a run
  where its segment has one), else gathered contiguous, one layer at a time. With quantized KV the chunk is
  quantized as it is written, and what comes back is decoded to the model's dtype: the
  chunk attends to exactly the K/V that later decode steps will read.
- `DecodeCache` (the batch, one token per row): writes each row's token into its own
  block, returns its inputs untouched, and answers attention itself through the rebound
  `scaled_dot_product_attention` (`engine.kv.attention`), which reads the pool through
  the block tables: no batch-sized K/V is ever assembled.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv.blocks import consecutive
from engine.kv.device_vectors import device_vector
from engine.kv.masks import additive_mask
from engine.kv.quant import KVQuant
from engine.kv.store import Allocation, KVStore, Segment, ring_slots, slots_of


class ReadsBack:
    """A layer's cache that layers sharing it read back (Gemma 3n's KV-shared layers call
    `keys_and_values()` on the owner's cache object, then attend through it under the
    owner's mask): the K/V the owner's `update_and_fetch` returned, read again from the pool
    (`_fetch`) rather than kept, so that no model's layers hold their K/V past the call. In a
    decode step the rebound attention answers the shared layers from the owner's blocks, as
    it answers the owner, and what is returned here is never evaluated."""

    _written = False

    def _fetch(self) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        if not self._written:
            raise ValueError("a KV-shared layer read its cache before the layer that owns it wrote")
        return self._fetch()


class PrefillCache(ReadsBack):
    def __init__(self, segment: Segment, layer: int, offset: int, write: mx.array | None,
                 read: mx.array | None,
                 quant: KVQuant | None = None, mask: mx.array | None = None,
                 run_start: int | None = None, width: int = 0, window: int | None = None,
                 mask_dtype: mx.Dtype = mx.float32) -> None:
        self.segment = segment
        self.layer = layer  # the layer's array in the segment (its slot in its group)
        self.window = window  # a window group's: `mask` is its band over the `width` keys read
        self._start = offset
        self._mask_dtype = mask_dtype
        self.offset = offset
        self._write = write
        self._read = read  # rows of the pool to gather; None where the K/V are one run
        self._quant = quant
        self._mask = mask  # keys padded past the chunk's end (engine.kv.buckets): masked out
        # The request's slots up to the chunk's end are one run from this slot: its K/V are
        # a strided view of the pool (`engine.kv.attention.run_decode` does the same), `width`
        # slots long (past the chunk's end where keys are padded: whatever lies there, masked).
        self._run_start = run_start
        self._width = width
        # The first full layer's cache of a lone request keeps its attention call's
        # queries, scale, mask and sinks when asked: the runner plans the next chunk's
        # shape from them (`engine.kv.plan_ahead`).
        self.records_call = False
        self.call: tuple[mx.array, float, Any, mx.array | None] | None = None

    @property
    def run_start(self) -> int | None:
        """The pool slot the request's K/V run from, where they are read as a view."""
        return self._run_start

    @property
    def quant(self) -> KVQuant | None:
        return self._quant

    @property
    def padded_mask(self) -> mx.array | None:
        """The mask over keys padded past the chunk's end (None: the keys are exact)."""
        return self._mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k = keys[0].transpose(1, 0, 2)  # [T, H, D]
        v = values[0].transpose(1, 0, 2)
        seg, layer, quant = self.segment, self.layer, self._quant
        # one run of slots: a slice update; else a scatter to each token's slot
        write = self._write if self._run_start is None else \
            slice(self._run_start + self.offset, self._run_start + self.offset + keys.shape[2])
        seg.keys[layer][write] = k if quant is None else quant.encode(k)
        seg.values[layer][write] = v if quant is None else quant.encode(v)
        self.offset += keys.shape[2]
        self._written = True
        return self._fetch()

    def _fetch(self) -> tuple[mx.array, mx.array]:
        seg, layer, quant = self.segment, self.layer, self._quant
        if self._run_start is not None:
            return run_view(seg.keys[layer], seg.values[layer], self._run_start, self._width, quant)
        k = pool_rows(seg.keys[layer])[self._read][None]
        v = pool_rows(seg.values[layer])[self._read][None]
        return (k, v) if quant is None else (quant.decode(k), quant.decode(v))

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if self.window is not None:
            return self._window_mask(n, return_array, window_size or self.window)
        if window_size is not None:
            raise ValueError("a full layer of the paged KV store was asked for a sliding-window mask")
        if self._mask is not None:
            return self._mask
        from mlx_lm.models.cache import create_attention_mask  # loaded with the model

        return create_attention_mask(
            n, offset=self.offset, return_array=return_array, window_size=window_size
        )

    def _window_mask(self, n: int, return_array: bool, band: int) -> Any:
        """A window layer's mask over the keys it reads (from its window - 1 positions before
        the chunk on, as mlx-lm's `RotatingKVCache` keeps them), for a band of `band` keys:
        its window unless the model asks another (plamo3 masks one more than it keeps)."""
        if band == self.window and not (return_array and isinstance(self._mask, str)):
            return self._mask
        start = self._start
        low = start + n - self._width
        return window_mask(np.asarray([start]), np.asarray([n]), np.asarray([low]), n, self._width, band,
                           self._mask_dtype, array=True)


def pool_rows(pool: mx.array) -> mx.array:
    """A layer's pool seen as [slots × heads, width]: one gather of [heads, L] row indices
    gives SDPA's layout directly."""
    slots, heads, width = pool.shape
    return pool.reshape(slots * heads, width)


def run_view(keys: mx.array, values: mx.array, start: int, length: int,
             quant: KVQuant | None = None) -> tuple[mx.array, mx.array]:
    """`length` consecutive slots of a layer's pool from `start`, as SDPA's [1, H, L, D]: a
    strided view, no copy; quantized rows decoded (one contiguous transient)."""
    k = keys[start : start + length].transpose(1, 0, 2)[None]
    v = values[start : start + length].transpose(1, 0, 2)[None]
    return (k, v) if quant is None else (quant.decode(k), quant.decode(v))


def prefill_caches(store: KVStore, alloc: Allocation, tokens: int) -> list[PrefillCache]:
    """Caches for running the request's next `tokens` prompt tokens after `alloc.length`,
    one per model layer: each reads its group's table (`KVGeometry.groups`)."""
    geo = store.geometry
    if len(geo.groups) == 1 and not geo.windowed:
        return _full_caches(store, alloc, alloc.table, tokens, geo.num_layers)
    per_group = [
        _full_caches(store, alloc, table, tokens, len(group.layers)) if group.window is None
        else _window_caches(store, alloc, table, group.window, tokens, len(group.layers))
        for group, table in zip(geo.groups, alloc.tables, strict=True)
    ]
    return [per_group[gi][slot] for gi, slot in geo.layer_slots]


def _full_caches(store: KVStore, alloc: Allocation, table: list[int], tokens: int,
                 layers: int) -> list[PrefillCache]:
    """A full group's caches: every key from position 0, padded where `KeyLengths` pads."""
    start = alloc.length
    end = start + tokens
    width = store.key_lengths.keys(tokens, end)
    store.key_lengths.ran(tokens, end, width)
    mask = None
    if width > end:  # filler past the end, masked out: SDPA sees a length it has planned
        query = mx.arange(start, end, dtype=mx.int32)[:, None]
        mask = additive_mask((mx.arange(width, dtype=mx.int32)[None, :] <= query)[None, None],
                             store.geometry.dtype)
    blocks = table[: store.blocks_for(end)]
    first = blocks[0] * store.block_size
    if store.prefill_views and consecutive(blocks) and first + width <= alloc.segment.slots:
        # No gather: SDPA reads the request's K/V where they lie. Filler slots are whatever
        # follows them in the segment (finite: written K/V or zeros), masked out.
        return [
            PrefillCache(alloc.segment, layer, start, None, None, store.geometry.quant, mask,
                         run_start=first, width=width)
            for layer in range(layers)
        ]
    write = slots_of(table, store.block_size, end, start=start)
    slots = slots_of(table, store.block_size, end)
    if width > end:  # filler slots: the row's first
        slots = mx.concatenate([slots, mx.broadcast_to(slots[:1], (width - end,))])
    # rows of the pool seen as [slots × H, D], ordered head-major: one gather gives [H, L, D]
    heads = store.geometry.num_kv_heads
    read = slots[None, :] * heads + mx.arange(heads, dtype=mx.int32)[:, None]
    return [
        PrefillCache(alloc.segment, layer, start, write, read, store.geometry.quant, mask)
        for layer in range(layers)
    ]


def _window_caches(store: KVStore, alloc: Allocation, ring: list[int], window: int, tokens: int,
                   layers: int) -> list[PrefillCache]:
    """A window group's caches: the chunk is written into the ring, then each query reads
    the `window` keys up to itself, from `window - 1` positions before the chunk on."""
    if tokens > store.chunk_tokens:
        raise ValueError(f"a call of {tokens} tokens outgrows the rings sized for {store.chunk_tokens}")
    start = alloc.length
    end = start + tokens
    low = max(0, start - window + 1)
    bs, heads = store.block_size, store.geometry.num_kv_heads
    write = mx.array(ring_slots(ring, bs, start, end).astype(np.int32))
    slots = ring_slots(ring, bs, low, end)
    read = mx.array((slots[None, :] * heads + np.arange(heads)[:, None]).astype(np.int32))
    mask = window_mask(np.asarray([start]), np.asarray([tokens]), np.asarray([low]), tokens, end - low,
                       window, store.geometry.dtype)
    return [
        PrefillCache(alloc.segment, slot, start, write, read, store.geometry.quant, mask,
                     width=end - low, window=window, mask_dtype=store.geometry.dtype)
        for slot in range(layers)
    ]


def window_mask(starts: np.ndarray, lengths: np.ndarray, lows: np.ndarray, queries: int, keys: int,
                window: int, dtype: mx.Dtype, *, array: bool = False) -> mx.array | str:
    """The band each row's queries attend in a window group: row b's query t is position
    `starts[b] + t`, its key j position `lows[b] + j`, seen where `q - window < k <= q`
    and `j < starts[b] + lengths[b] - lows[b]` (mlx-lm's `create_causal_mask` with a
    window). "causal" where no query has more than `window` keys behind it and nothing is
    padded: SDPA's own mask, aligned to the end of the keys. Padded queries (past a row's
    length) attend as its last real one: never an empty row."""
    ends = starts + lengths
    if not array and len(starts) == 1 and keys == ends[0] - lows[0] and keys <= window \
            and queries == lengths[0]:
        return "causal"
    return additive_mask(mx.array(band_allowed(starts, lengths, lows, queries, keys, window)), dtype)


def band_allowed(starts: np.ndarray, lengths: np.ndarray, lows: np.ndarray, queries: int, keys: int,
                 window: int | None) -> np.ndarray:
    """[B, 1, queries, keys] bool: row b's query t (position `starts[b] + t`, padded queries
    as its last real one) sees key j (position `lows[b] + j`) where `k <= q`, `k > q - window`
    (no lower bound for a full layer) and the key was written."""
    ends = starts + lengths
    t = np.minimum(np.arange(queries)[None, :, None], lengths[:, None, None] - 1)
    q = starts[:, None, None] + t
    k = lows[:, None, None] + np.arange(keys)[None, None, :]
    allowed = (k <= q) & (k < ends[:, None, None])
    if window is not None:
        allowed &= k > q - window
    return allowed[:, None]


@dataclass
class DecodeGroup:
    """The rows of one decode step that live in one segment, in one layer group."""

    segment: Segment
    rows: mx.array | None  # row indices into the batch; None = all rows, in order
    write: mx.array  # [Bg] slot of each row's new token
    table: mx.array  # [Bg, NB] int32 block tables, zero-padded
    lengths: mx.array  # [Bg] int32 tokens each row attends to, the new one included
    max_length: int
    read: mx.array | None = None  # [Bg, H, L] rows of the pool, built lazily (plain path)
    mask: mx.array | None = None
    kernel: bool | None = None  # the CUDA kernel attends this group (decided at its first layer)
    # A group of one row whose blocks are one run of consecutive ids: the slot its K/V starts
    # at, so that attention reads one slice of the pool (`engine.kv.attention.run_decode`).
    run_start: int | None = None
    # A window group (`memory.paged`): the keys a row attends, and each row's ring in slots.
    window: int | None = None
    ring: mx.array | None = None  # [Bg] int32, in slots
    ring_blocks: mx.array | None = None  # the same in blocks (the CUDA kernel's)
    run_slots: int = 0  # a lone row's ring in slots (its view stops there)

    def plain_blocks(self, block_size: int) -> int:
        """Blocks the plain path gathers per row: its graph's only use of the length."""
        blocks = -(-self.max_length // block_size)
        return blocks if self.ring is None else min(blocks, self.table.shape[1])

    def gather_rows(self, block_size: int, blocks: int, kv_heads: int) -> mx.array:
        """[Bg, H, blocks × block_size] rows of the pool (`pool_rows`) holding each row's
        first `blocks` blocks; past its table, slot 0 (masked by the caller)."""
        if self.read is None or self.read.shape[-1] != blocks * block_size:
            table = self.table[:, :blocks]
            if table.shape[1] < blocks:
                table = mx.pad(table, [(0, 0), (0, blocks - table.shape[1])])
            within = mx.arange(block_size, dtype=mx.int32)
            slots = (table[:, :, None] * block_size + within[None, None, :]).reshape(table.shape[0], -1)
            self.read = slots[:, None, :] * kv_heads + mx.arange(kv_heads, dtype=mx.int32)[None, :, None]
        return self.read

    def plain_indices(self, block_size: int, kv_heads: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Indices into the pool seen as [slots × H, D], so that one gather yields K in
        SDPA's [B, H, L, D] layout directly (no transposed copy), and the length mask,
        additive in `dtype` (`engine.kv.masks.additive_mask` says why). In a ring, slot r
        of a row at position p holds position p - ((p - r) mod ring): seen if that is at
        most `window - 1` back and not before position 0."""
        if self.mask is None:
            nb = self.plain_blocks(block_size)
            self.gather_rows(block_size, nb, kv_heads)
            positions = mx.arange(nb * block_size, dtype=mx.int32)[None, :]
            if self.ring is None:
                seen = positions < self.lengths[:, None]
            else:
                last, ring = self.lengths[:, None] - 1, self.ring[:, None]
                back = mx.remainder(last - positions, ring)
                seen = (positions < ring) & (back <= last) & (back < (self.window or 0))
            self.mask = additive_mask(seen[:, None, None, :], dtype)
        assert self.read is not None and self.mask is not None
        return self.read, self.mask


@dataclass
class DecodePlan:
    """Everything one decode step needs to address the store, built once per step."""

    groups: list[DecodeGroup]  # the first layer group's (every layer's, where there is one)
    offsets: mx.array  # [B] position of each row's new token
    order: mx.array | None  # undoes the grouping of rows; None when there is one group
    block_size: int
    quant: KVQuant | None = None  # the pool's rows are quantized (engine.kv.quant)
    more: tuple[list[DecodeGroup], ...] = ()  # the other layer groups' (`KVGeometry.groups`)
    layer_slots: tuple[tuple[int, int], ...] = ()  # (layer group, slot) per layer; () = (0, layer)
    gather: bool = False  # `KVGeometry.gather`: hand the model each row's K/V and a length mask
    _lengths_mask: mx.array | None = None

    def gathered(self, groups: list[DecodeGroup], slot: int) -> tuple[mx.array, mx.array]:
        """Every row's K/V of one layer, [B, H, L, D] in batch order, L the longest row's
        blocks (the rest masked by `length_mask`)."""
        blocks = max(g.plain_blocks(self.block_size) for g in groups)
        keys, values = [], []
        for g in groups:
            read = g.gather_rows(self.block_size, blocks, g.segment.keys[slot].shape[1])
            keys.append(pool_rows(g.segment.keys[slot])[read])
            values.append(pool_rows(g.segment.values[slot])[read])
        if self.order is None:
            return keys[0], values[0]
        return mx.concatenate(keys, axis=0)[self.order], mx.concatenate(values, axis=0)[self.order]

    def length_mask(self, groups: list[DecodeGroup]) -> mx.array:
        """[B, 1, 1, L] bool: the keys `gathered` returns that each row has written."""
        if self._lengths_mask is None:
            blocks = max(g.plain_blocks(self.block_size) for g in groups)
            positions = mx.arange(blocks * self.block_size, dtype=mx.int32)[None, :]
            self._lengths_mask = (positions <= self.offsets[:, None])[:, None, None, :]
        return self._lengths_mask

    def all_groups(self) -> list[DecodeGroup]:
        """Every layer group's groups of rows, the first layer group's first."""
        return [*self.groups, *(g for more in self.more for g in more)]

    def layout(self) -> tuple[int, ...]:
        """How many groups of rows each layer group has (`all_groups` in order)."""
        return (len(self.groups), *(len(more) for more in self.more))

    def of_layer(self, layer: int) -> tuple[list[DecodeGroup], int]:
        """The groups of rows a layer attends through, and its array in their segments."""
        if not self.layer_slots:
            return self.groups, layer
        gi, slot = self.layer_slots[layer]
        return (self.groups if gi == 0 else self.more[gi - 1]), slot


@dataclass(frozen=True)
class _Tables:
    """One layer group's tables for a segment's rows, kept while the rows stay."""

    table: np.ndarray  # [Bg, NB] int32 block tables, zero-padded to `table_width`
    table_array: mx.array
    run_block: int | None  # one row on consecutive blocks: its first block (DecodeGroup.run_start)
    caps: np.ndarray | None = None  # a window group's rows' ring lengths in blocks
    ring_slots: mx.array | None = None  # the same in slots, on the device
    ring_blocks: mx.array | None = None


@dataclass(frozen=True)
class _GroupTables:
    rows: list[int]  # row indices into the batch
    rows_array: mx.array | None  # the same on the device; None = all rows, in order
    parts: tuple[_Tables, ...]  # per layer group (`KVGeometry.groups`)

    @property
    def run_block(self) -> int | None:
        return self.parts[0].run_block


class DecodeTables:
    """The batch's block tables, kept from one decode step to the next while its rows stay
    the same. A reservation's blocks are fixed when it is made (`KVStore.reserve`), so
    between steps only each row's length, and so its write slot, moves: rebuilding the
    tables every step cost the host ~0.1 ms per 32 rows on the CPU, and 2.7 % of the
    engine thread's samples at C=32 on the H200 (docs/throughput.md).

    It holds the reservations only weakly and no segment at all: a released request's
    segment must go back to the device, not stay alive in a cache.

    With `runs`, a group of one row whose blocks are consecutive is planned as one slice of
    the pool (`DecodeGroup.run_start`). A reservation's blocks cover its whole prompt and
    `max_tokens`, so that holds for the row's life once it holds at the join."""

    def __init__(self, runs: bool = False) -> None:
        self.runs = runs  # read at each plan: the runner may switch it between steps
        self._allocs: list[weakref.ref[Allocation]] = []
        self._groups: list[_GroupTables] = []
        self._order: mx.array | None = None

    @property
    def lone_run(self) -> bool:
        """The kept batch is one row on consecutive blocks: a slice could read it, whether
        or not `runs` lets it (engine.slice_choice times both paths on such rows)."""
        return len(self._groups) == 1 and self._groups[0].run_block is not None

    def keep(self, allocs: list[Allocation], store: KVStore) -> None:
        """Rebuild the tables if the batch's rows changed since the last step."""
        if not _same_rows(allocs, self._allocs):
            self._build(allocs, store)

    def plan(self, store: KVStore, allocs: list[Allocation]) -> DecodePlan:
        self.keep(allocs, store)
        bs = store.block_size
        positions = np.fromiter((a.length for a in allocs), dtype=np.int32, count=len(allocs))
        geo = store.geometry
        per_group: list[list[DecodeGroup]] = [[] for _ in geo.groups]
        for t in self._groups:
            pos = positions if t.rows_array is None else positions[t.rows]
            segment = allocs[t.rows[0]].segment
            lengths, max_length = device_vector(pos + 1), int(pos.max()) + 1
            index = np.arange(len(pos))
            for gi, (part, group) in enumerate(zip(t.parts, geo.groups, strict=True)):
                blocks = pos // bs if part.caps is None else (pos // bs) % part.caps
                per_group[gi].append(DecodeGroup(
                    segment=segment, rows=t.rows_array,
                    write=device_vector(part.table[index, blocks] * bs + pos % bs),
                    table=part.table_array, lengths=lengths, max_length=max_length,
                    run_start=None if part.run_block is None or not self.runs else part.run_block * bs,
                    window=group.window, ring=part.ring_slots, ring_blocks=part.ring_blocks,
                    run_slots=0 if part.caps is None else int(part.caps[0]) * bs,
                ))
        slots = geo.layer_slots if len(geo.groups) > 1 else ()
        return DecodePlan(per_group[0], device_vector(positions), self._order, bs, geo.quant,
                          tuple(per_group[1:]), slots, gather=geo.gather)

    def _build(self, allocs: list[Allocation], store: KVStore) -> None:
        by_segment: dict[int, list[int]] = {}
        for i, a in enumerate(allocs):
            by_segment.setdefault(a.segment.id, []).append(i)
        single = len(by_segment) == 1
        self._groups = []
        for rows in by_segment.values():
            members = [allocs[i] for i in rows]
            parts = []
            for gi, group in enumerate(store.geometry.groups):
                tables = [a.tables[gi] for a in members]
                padded = _padded_tables(tables)
                run = tables[0] if len(members) == 1 and consecutive(tables[0]) else None
                caps = None
                if group.window is not None:
                    caps = np.asarray([len(t) for t in tables], dtype=np.int64)
                parts.append(_Tables(
                    padded, mx.array(padded), run[0] if run else None, caps,
                    None if caps is None else device_vector(caps * store.block_size),
                    None if caps is None else device_vector(caps),
                ))
            self._groups.append(_GroupTables(rows, None if single else device_vector(rows), tuple(parts)))
        self._order = None
        if not single:
            flat = np.concatenate([np.asarray(r) for r in by_segment.values()])
            self._order = device_vector(np.argsort(flat))
        self._allocs = [weakref.ref(a) for a in allocs]


def _padded_tables(tables: list[list[int]]) -> np.ndarray:
    """Rows' block tables, zero-padded to one `table_width`."""
    out = np.zeros((len(tables), table_width(max(len(t) for t in tables))), dtype=np.int32)
    for j, t in enumerate(tables):
        out[j, : len(t)] = t
    return out


def table_width(capacity: int) -> int:
    """A group's block-table width: its longest row's capacity rounded up to a power of two.
    The width is in a traced decode graph's shapes (`engine.compiled_decode`), so requests
    of nearby sizes share graphs instead of each tracing its own; the padding is never read
    (attention stops at each row's length)."""
    return 1 << max(capacity - 1, 0).bit_length()


def _same_rows(allocs: list[Allocation], kept: list[weakref.ref[Allocation]]) -> bool:
    """The same reservations in the same order (a re-reserved request is a new one)."""
    return len(allocs) == len(kept) and all(a is k() for a, k in zip(allocs, kept, strict=True))


def plan_decode(store: KVStore, allocs: list[Allocation], tables: DecodeTables | None = None) -> DecodePlan:
    """One decode step's addressing of the store; `tables` keeps the block tables between
    steps (the engine's runner passes its own), None builds them afresh."""
    return (tables or DecodeTables()).plan(store, allocs)


class DecodeCache(ReadsBack):
    def __init__(self, plan: DecodePlan, layer: int) -> None:
        self.plan = plan
        self.layer = layer
        self.offset = plan.offsets
        # the rows' groups of this layer's group, and the layer's array in their segments
        self.groups, self.slot = plan.of_layer(layer)
        self.window = self.groups[0].window if self.groups else None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k_all, v_all = keys[:, :, 0, :], values[:, :, 0, :]
        quant = self.plan.quant
        if quant is not None:
            k_all, v_all = quant.encode(k_all), quant.encode(v_all)
        for g in self.groups:
            k, v = k_all, v_all
            if g.rows is not None:
                k, v = k[g.rows], v[g.rows]
            g.segment.keys[self.slot][g.write] = k
            g.segment.values[self.slot][g.write] = v
        self._written = True
        if self.plan.gather:  # the model attends itself, over every row's K/V
            return self._fetch()
        return keys, values

    def _fetch(self) -> tuple[mx.array, mx.array]:
        return self.plan.gathered(self.groups, self.slot)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if self.plan.gather and n == 1 and window_size is None:
            return self.plan.length_mask(self.groups) if return_array else None
        if n != 1 or (window_size is not None and (self.window is None or window_size < self.window)):
            raise ValueError(f"the paged decode cache runs one token per row, each over its layer's "
                             f"window (asked {n} tokens, window {window_size}; the layer's {self.window})")
        return None  # each row's band is the attention's own (`engine.kv.attention`)


def decode_caches(plan: DecodePlan, num_layers: int) -> list[DecodeCache]:
    return [DecodeCache(plan, layer) for layer in range(num_layers)]
