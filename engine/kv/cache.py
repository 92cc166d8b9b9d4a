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
from engine.kv.store import Allocation, KVStore, Segment, slots_of


class PrefillCache:
    def __init__(self, segment: Segment, layer: int, offset: int, write: mx.array | None,
                 read: mx.array | None,
                 quant: KVQuant | None = None, mask: mx.array | None = None,
                 run_start: int | None = None, width: int = 0) -> None:
        self.segment = segment
        self.layer = layer
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
        if self._run_start is not None:
            return run_view(seg.keys[layer], seg.values[layer], self._run_start, self._width, quant)
        slots, heads, width = seg.keys[layer].shape
        k = seg.keys[layer].reshape(slots * heads, width)[self._read][None]
        v = seg.values[layer].reshape(slots * heads, width)[self._read][None]
        return (k, v) if quant is None else (quant.decode(k), quant.decode(v))

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if self._mask is not None:
            if window_size is not None:
                raise ValueError("the paged KV store does not serve sliding-window attention")
            return self._mask
        from mlx_lm.models.cache import create_attention_mask  # loaded with the model

        return create_attention_mask(
            n, offset=self.offset, return_array=return_array, window_size=window_size
        )


def run_view(keys: mx.array, values: mx.array, start: int, length: int,
             quant: KVQuant | None = None) -> tuple[mx.array, mx.array]:
    """`length` consecutive slots of a layer's pool from `start`, as SDPA's [1, H, L, D]: a
    strided view, no copy; quantized rows decoded (one contiguous transient)."""
    k = keys[start : start + length].transpose(1, 0, 2)[None]
    v = values[start : start + length].transpose(1, 0, 2)[None]
    return (k, v) if quant is None else (quant.decode(k), quant.decode(v))


def prefill_caches(store: KVStore, alloc: Allocation, tokens: int) -> list[PrefillCache]:
    """Caches for running the request's next `tokens` prompt tokens after `alloc.length`."""
    start = alloc.length
    end = start + tokens
    width = store.key_lengths.keys(tokens, end)
    store.key_lengths.ran(tokens, end, width)
    mask = None
    if width > end:  # filler past the end, masked out: SDPA sees a length it has planned
        query = mx.arange(start, end, dtype=mx.int32)[:, None]
        mask = additive_mask((mx.arange(width, dtype=mx.int32)[None, :] <= query)[None, None],
                             store.geometry.dtype)
    blocks = alloc.table[: store.blocks_for(end)]
    first = blocks[0] * store.block_size
    if store.prefill_views and consecutive(blocks) and first + width <= alloc.segment.slots:
        # No gather: SDPA reads the request's K/V where they lie. Filler slots are whatever
        # follows them in the segment (finite: written K/V or zeros), masked out.
        return [
            PrefillCache(alloc.segment, layer, start, None, None, store.geometry.quant, mask,
                         run_start=first, width=width)
            for layer in range(store.geometry.num_layers)
        ]
    write = slots_of(alloc.table, store.block_size, end, start=start)
    slots = slots_of(alloc.table, store.block_size, end)
    if width > end:  # filler slots: the row's first
        slots = mx.concatenate([slots, mx.broadcast_to(slots[:1], (width - end,))])
    # rows of the pool seen as [slots × H, D], ordered head-major: one gather gives [H, L, D]
    heads = store.geometry.num_kv_heads
    read = slots[None, :] * heads + mx.arange(heads, dtype=mx.int32)[:, None]
    return [
        PrefillCache(alloc.segment, layer, start, write, read, store.geometry.quant, mask)
        for layer in range(store.geometry.num_layers)
    ]


@dataclass
class DecodeGroup:
    """The rows of one decode step that live in one segment."""

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

    def plain_blocks(self, block_size: int) -> int:
        """Blocks the plain path gathers per row: its graph's only use of the length."""
        return -(-self.max_length // block_size)

    def plain_indices(self, block_size: int, kv_heads: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Indices into the pool seen as [slots × H, D], so that one gather yields K in
        SDPA's [B, H, L, D] layout directly (no transposed copy), and the length mask,
        additive in `dtype` (`engine.kv.masks.additive_mask` says why)."""
        if self.read is None:
            nb = self.plain_blocks(block_size)
            table = self.table[:, :nb]
            within = mx.arange(block_size, dtype=mx.int32)
            slots = (table[:, :, None] * block_size + within[None, None, :]).reshape(table.shape[0], -1)
            heads = mx.arange(kv_heads, dtype=mx.int32)
            self.read = slots[:, None, :] * kv_heads + heads[None, :, None]
            positions = mx.arange(nb * block_size, dtype=mx.int32)
            self.mask = additive_mask((positions[None, :] < self.lengths[:, None])[:, None, None, :], dtype)
        assert self.mask is not None
        return self.read, self.mask


@dataclass
class DecodePlan:
    """Everything one decode step needs to address the store, built once per step."""

    groups: list[DecodeGroup]
    offsets: mx.array  # [B] position of each row's new token
    order: mx.array | None  # undoes the grouping of rows; None when there is one group
    block_size: int
    quant: KVQuant | None = None  # the pool's rows are quantized (engine.kv.quant)


@dataclass(frozen=True)
class _GroupTables:
    rows: list[int]  # row indices into the batch
    rows_array: mx.array | None  # the same on the device; None = all rows, in order
    table: np.ndarray  # [Bg, NB] int32 block tables, zero-padded to `table_width`
    table_array: mx.array
    run_block: int | None  # one row on consecutive blocks: its first block (DecodeGroup.run_start)


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

    def keep(self, allocs: list[Allocation]) -> None:
        """Rebuild the tables if the batch's rows changed since the last step."""
        if not _same_rows(allocs, self._allocs):
            self._build(allocs)

    def plan(self, store: KVStore, allocs: list[Allocation]) -> DecodePlan:
        self.keep(allocs)
        bs = store.block_size
        positions = np.fromiter((a.length for a in allocs), dtype=np.int32, count=len(allocs))
        groups = []
        for t in self._groups:
            pos = positions if t.rows_array is None else positions[t.rows]
            write = t.table[np.arange(len(pos)), pos // bs] * bs + pos % bs
            groups.append(DecodeGroup(
                segment=allocs[t.rows[0]].segment, rows=t.rows_array, write=device_vector(write),
                table=t.table_array, lengths=device_vector(pos + 1), max_length=int(pos.max()) + 1,
                run_start=None if t.run_block is None or not self.runs else t.run_block * bs,
            ))
        return DecodePlan(groups, device_vector(positions), self._order, bs, store.geometry.quant)

    def _build(self, allocs: list[Allocation]) -> None:
        by_segment: dict[int, list[int]] = {}
        for i, a in enumerate(allocs):
            by_segment.setdefault(a.segment.id, []).append(i)
        single = len(by_segment) == 1
        self._groups = []
        for rows in by_segment.values():
            members = [allocs[i] for i in rows]
            table = np.zeros((len(members), table_width(max(a.capacity for a in members))), dtype=np.int32)
            for j, a in enumerate(members):
                table[j, : a.capacity] = a.table
            run = members[0].table if len(members) == 1 else None
            self._groups.append(_GroupTables(
                rows, None if single else device_vector(rows),
                table, mx.array(table), run[0] if run and consecutive(run) else None,
            ))
        self._order = None
        if not single:
            flat = np.concatenate([np.asarray(r) for r in by_segment.values()])
            self._order = device_vector(np.argsort(flat))
        self._allocs = [weakref.ref(a) for a in allocs]


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


class DecodeCache:
    def __init__(self, plan: DecodePlan, layer: int) -> None:
        self.plan = plan
        self.layer = layer
        self.offset = plan.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k_all, v_all = keys[:, :, 0, :], values[:, :, 0, :]
        quant = self.plan.quant
        if quant is not None:
            k_all, v_all = quant.encode(k_all), quant.encode(v_all)
        for g in self.plan.groups:
            k, v = k_all, v_all
            if g.rows is not None:
                k, v = k[g.rows], v[g.rows]
            g.segment.keys[self.layer][g.write] = k
            g.segment.values[self.layer][g.write] = v
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> None:
        if n != 1 or window_size is not None:
            raise ValueError("the paged decode cache runs one token per row, without windows")
        return None


def decode_caches(plan: DecodePlan, num_layers: int) -> list[DecodeCache]:
    return [DecodeCache(plan, layer) for layer in range(num_layers)]
