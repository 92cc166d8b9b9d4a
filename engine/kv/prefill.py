"""Batched prefill: several requests' prompt chunks in one model call, over the KV store.

Rows are right-padded to the longest chunk of the call: ``tokens`` is ``[B, T]``, row
``b`` holds ``lengths[b]`` real tokens that continue its request at position
``starts[b]``. Per layer, `BatchPrefillCache`

- writes only the real tokens into each row's own blocks (one scatter: padded positions
  never touch the pool, so a row whose reservation ends at its chunk is safe), quantized
  first where the store's KV is (`engine.kv.quant`);
- returns every row's K/V gathered from position 0 up to its chunk's end, in SDPA's
  ``[B, H, L, D]`` layout (L = the longest row's end, padded where the backend plans
  attention per shape, `engine.kv.buckets`; shorter rows read their first slot as filler,
  masked out), decoded to the model's dtype where the KV is quantized;
- supplies a per-row mask (row b's query t sees keys ``j <= starts[b] + t`` that are
  real) and per-row RoPE offsets (``starts``), which `mx.fast.rope` takes as an array.
  When every row has the same start and length (no padding), the mask is SDPA's
  "causal", which costs nothing; otherwise it is additive, in the pool's dtype
  (`engine.kv.masks.additive_mask` says why not boolean).

The attention itself is mlx-lm's ordinary masked SDPA. A batch of one keeps the
single-request `PrefillCache` ("causal" mask, no padding): the fused path where a backend
has one. All rows of one call live in one segment; `group_by_segment` splits a step's
chunks accordingly.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.kv.cache import ReadsBack, band_allowed, pool_rows, window_mask
from engine.kv.masks import additive_mask
from engine.kv.quant import KVQuant
from engine.kv.store import Allocation, KVStore, Segment, ring_slots


@dataclass(frozen=True)
class PrefillRow:
    alloc: Allocation
    tokens: tuple[int, ...]  # this chunk's prompt tokens (continuing at alloc.length)


@dataclass(frozen=True)
class GroupPart:
    """One layer group's addressing in a batched prefill call."""

    write: mx.array  # [N] int32: the real tokens' slots in the segment
    read: mx.array  # [B, H, L] int32: rows of the pool seen as [slots × H, D]
    mask: mx.array | str  # [B, 1, T, L] additive, model's dtype; "causal" when every row is the same shape
    window: int | None = None
    # the rows (starts, lengths, first keys), for a mask of another band or a boolean one
    rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    dtype: mx.Dtype = mx.float32

    def band(self, window: int) -> mx.array | str:
        assert self.rows is not None
        starts, lengths, lows = self.rows
        return window_mask(starts, lengths, lows, int(lengths.max()), int(self.read.shape[-1]), window,
                           self.dtype)

    def allowed(self, window: int | None) -> mx.array:
        """The mask as booleans (a model that asks for an array, as MLA's does to mask its
        own scores)."""
        assert self.rows is not None
        starts, lengths, lows = self.rows
        return mx.array(band_allowed(starts, lengths, lows, int(lengths.max()), int(self.read.shape[-1]),
                                     window))


@dataclass
class PrefillPlan:
    """Index arrays of one batched prefill call, built once and shared by every layer."""

    segment: Segment
    inputs: mx.array  # [B, T] uint32, right-padded with 0
    starts: mx.array  # [B] int32: position of each row's first chunk token (RoPE offset)
    valid: mx.array  # [N] int32: real tokens' indices into the flattened [B × T]
    parts: tuple[GroupPart, ...]  # each layer group's addressing (`KVGeometry.groups`)
    quant: KVQuant | None = None  # the pool's rows are quantized (engine.kv.quant)
    layer_slots: tuple[tuple[int, int], ...] = ()  # (layer group, slot) per layer; () = (0, layer)

    @property
    def write(self) -> mx.array:
        """[N] int32: the real tokens' slots in the segment (the first layer group's)."""
        return self.parts[0].write

    @property
    def read(self) -> mx.array:
        """[B, H, L] int32: rows of the pool seen as [slots × H, D] (the first group's)."""
        return self.parts[0].read

    @property
    def mask(self) -> mx.array | str:
        """[B, 1, T, L] additive, model's dtype; "causal" when every row is the same shape."""
        return self.parts[0].mask

    def of_layer(self, layer: int) -> tuple[GroupPart, int]:
        gi, slot = self.layer_slots[layer] if self.layer_slots else (0, layer)
        return self.parts[gi], slot


def plan_prefill(store: KVStore, rows: Seq[PrefillRow]) -> PrefillPlan:
    if not rows:
        raise ValueError("a prefill call needs at least one row")
    segment = rows[0].alloc.segment
    if any(r.alloc.segment is not segment for r in rows):
        raise ValueError("one prefill call reads one segment; group rows with group_by_segment")
    b = len(rows)
    t = max(len(r.tokens) for r in rows)
    starts = np.asarray([r.alloc.length for r in rows], dtype=np.int64)
    lengths = np.asarray([len(r.tokens) for r in rows], dtype=np.int64)
    inputs = np.zeros((b, t), dtype=np.uint32)
    valid: list[np.ndarray] = []
    for i, r in enumerate(rows):
        inputs[i, : lengths[i]] = r.tokens
        valid.append(i * t + np.arange(lengths[i]))
    geo = store.geometry
    parts = [
        _full_part(store, rows, starts, lengths, t, gi) if group.window is None
        else _window_part(store, rows, starts, lengths, t, gi, group.window)
        for gi, group in enumerate(geo.groups)
    ]
    return PrefillPlan(
        segment=segment,
        inputs=mx.array(inputs),
        starts=mx.array(starts.astype(np.int32)),
        valid=mx.array(np.concatenate(valid).astype(np.int32)),
        parts=tuple(parts),
        quant=geo.quant,
        layer_slots=geo.layer_slots if len(geo.groups) > 1 else (),
    )


def _full_part(store: KVStore, rows: Seq[PrefillRow], starts: np.ndarray, lengths: np.ndarray,
               t: int, gi: int) -> GroupPart:
    """A full group: every row's keys from position 0 to its end, padded to the call's."""
    bs, heads = store.block_size, store.geometry.num_kv_heads
    b = len(rows)
    ends = starts + lengths
    end = int(ends.max())
    same_shape = not needs_array_mask(starts.tolist(), lengths.tolist())
    # past the furthest end: filler, masked; rows of one shape may attend exact keys, causal
    width = store.key_lengths.call_keys(t, end, b, ragged=not same_shape)
    store.key_lengths.ran(t, end, width, b)
    write: list[np.ndarray] = []
    slots = np.empty((b, width), dtype=np.int64)
    for i, r in enumerate(rows):
        table = np.asarray(r.alloc.tables[gi], dtype=np.int64)
        pos = np.arange(ends[i])
        own = table[pos // bs] * bs + pos % bs
        slots[i, : ends[i]] = own
        slots[i, ends[i]:] = own[0] if len(own) else 0  # filler, masked out below
        write.append(own[starts[i]:])
    read = slots[:, None, :] * heads + np.arange(heads)[None, :, None]
    mask: mx.array | str
    if same_shape and width == end:
        # Rows of one shape (prompts of one length, say): SDPA's own causal mask aligns
        # the queries to the end of the keys, which is exactly right, and costs no memory.
        mask = "causal"
    else:
        q = np.arange(t)[None, :, None]
        k = np.arange(width)[None, None, :]
        allowed = mx.array(((k <= starts[:, None, None] + q) & (k < ends[:, None, None]))[:, None, :, :])
        mask = additive_mask(allowed, store.geometry.dtype)
    return GroupPart(mx.array(np.concatenate(write).astype(np.int32)), mx.array(read.astype(np.int32)), mask,
                     rows=(starts, lengths, np.zeros_like(starts)))


def _window_part(store: KVStore, rows: Seq[PrefillRow], starts: np.ndarray, lengths: np.ndarray,
                 t: int, gi: int, window: int) -> GroupPart:
    """A window group: each row writes its chunk into its ring, then reads from `window - 1`
    positions before its chunk to its end (`engine.kv.cache.window_mask`)."""
    if t > store.chunk_tokens:
        raise ValueError(f"a call of {t} tokens outgrows the rings sized for {store.chunk_tokens}")
    bs, heads = store.block_size, store.geometry.num_kv_heads
    ends = starts + lengths
    lows = np.maximum(starts - window + 1, 0)
    width = int((ends - lows).max())
    slots = np.empty((len(rows), width), dtype=np.int64)
    write: list[np.ndarray] = []
    for i, r in enumerate(rows):
        ring = r.alloc.tables[gi]
        own = ring_slots(ring, bs, int(lows[i]), int(ends[i]))
        slots[i, : len(own)] = own
        slots[i, len(own):] = own[0]  # filler, masked out
        write.append(own[starts[i] - lows[i]:])
    read = slots[:, None, :] * heads + np.arange(heads)[None, :, None]
    mask = window_mask(starts, lengths, lows, t, width, window, store.geometry.dtype)
    return GroupPart(mx.array(np.concatenate(write).astype(np.int32)), mx.array(read.astype(np.int32)),
                     mask, window, (starts, lengths, lows), store.geometry.dtype)


def needs_array_mask(starts: Seq[int], lengths: Seq[int]) -> bool:
    """Whether a call's rows need a mask of their own: they differ in start or length.
    Rows of one shape take SDPA's "causal" (the admission asks the same question to
    predict the call, `engine.admission.Admission.batch_prediction`)."""
    return len(set(starts)) > 1 or len(set(lengths)) > 1


class BatchPrefillCache(ReadsBack):
    """One layer's view of a batched prefill call (see the module docstring)."""

    def __init__(self, plan: PrefillPlan, layer: int) -> None:
        self.plan = plan
        self.offset = plan.starts
        # this layer's group's addressing, and its array in the segment
        self.part, self.layer = plan.of_layer(layer)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, heads, t, dim = keys.shape
        plan, part, seg, layer, quant = self.plan, self.part, self.plan.segment, self.layer, self.plan.quant
        k = keys.transpose(0, 2, 1, 3).reshape(b * t, heads, dim)[plan.valid]
        v = values.transpose(0, 2, 1, 3).reshape(b * t, heads, values.shape[-1])[plan.valid]
        seg.keys[layer][part.write] = k if quant is None else quant.encode(k)
        seg.values[layer][part.write] = v if quant is None else quant.encode(v)
        self._written = True
        return self._fetch()

    def _fetch(self) -> tuple[mx.array, mx.array]:
        seg, layer, quant = self.plan.segment, self.layer, self.plan.quant
        k = pool_rows(seg.keys[layer])[self.part.read]
        v = pool_rows(seg.values[layer])[self.part.read]
        return (k, v) if quant is None else (quant.decode(k), quant.decode(v))

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str:
        window = self.part.window
        if window is None and window_size is not None:
            raise ValueError("a full layer of the paged KV store was asked for a sliding-window mask")
        band = window_size or window
        if return_array:
            return self.part.allowed(band)
        if window is not None and window_size not in (None, window):
            return self.part.band(window_size)  # plamo3 masks one more than it keeps
        return self.part.mask


def batch_prefill_caches(plan: PrefillPlan, num_layers: int) -> list[BatchPrefillCache]:
    return [BatchPrefillCache(plan, layer) for layer in range(num_layers)]


def group_by_segment(rows: Seq[PrefillRow]) -> list[list[PrefillRow]]:
    """Rows in call order, grouped by the segment they live in (first appearance first)."""
    groups: dict[int, list[PrefillRow]] = {}
    for r in rows:
        groups.setdefault(r.alloc.segment.id, []).append(r)
    return list(groups.values())
