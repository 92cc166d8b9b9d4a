"""mlx-lm's own cache objects, held per request, with the paged store's interface.

A request admitted here gets `make_prompt_cache(model)` when it is reserved; its prefill
chunks run into those caches. When it joins the decode batch its caches are merged into
the batch's (`merge` makes a batch of one, `extend` appends it, as mlx-lm's
`BatchGenerator` does) and when it leaves, its row is filtered out. A model with a cache
kind that has no `merge` (llama4's `ChunkedKVCache`, `QuantizedKVCache`), or whose forward
cannot take rows at different offsets (`CacheLayout.batched`: gpt_bigcode) or a left-padded
row (`UNPADDABLE`), keeps every request's own caches and steps its rows one at a time.

Bytes. Nothing is allocated up front: a request's reservation is what its caches hold at
most (`CacheLayout.bytes_for`: full layers in 256-token steps, window layers at most the
window plus a prefill chunk, recurrent state at its fixed size), and `request_bytes` is
what the caches hold now, read from their arrays. The merged batch is left-padded to its
longest row, so its full layers may hold more than its rows' own sizes: the requests'
reservations together (`rows_reservation_bytes`) count every row at the longest's length
there.

Prefix caching (`engine.dense.prefix`): `hold_prefix` snapshots a request's caches when
they hold exactly the tokens asked for (a row that left the batch keeps its extracted
caches until it is released, so its prompt and answer can be kept), and a reservation
that a snapshot serves resumes from a copy of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.cache_layout import FULL, KV_STEP, CacheLayout
from engine.dense.prefix import Snapshot, restore, take_snapshot
from engine.kv.buckets import KeyLengths
from engine.kv.store import KVStoreStats, SharedPrefix


@dataclass
class DenseAllocation:
    """One request's place: its own caches until it joins the batch (rows of a model
    whose caches cannot merge keep them)."""

    request_id: str
    tokens: int  # reserved: prompt + max_tokens
    caches: list[Any] | None
    length: int = 0  # tokens written
    in_batch: bool = False
    shared: int = field(default=0)  # never shares (the paged Allocation's field)


# Model types whose forward goes wrong on a left-padded batch row, by mlx-lm module: their
# rows step one at a time, as generate_step runs them.
UNPADDABLE = {
    # the KV-reuse layers rotate queries by the shared keys' length, which padding lengthens
    "mlx_lm.models.afm7",
    # the sparse layers cut key blocks over cache slots, which padding shifts
    "mlx_lm.models.minimax_m3_vl",
}


# Model types whose forward gives other tokens when their first chunk runs right-padded
# beside other prompts (found by tests/engine/test_arch_matrix.py): their prompts prefill
# one request per call.
UNPADDED_PREFILL = {
    "mlx_lm.models.bailing_moe_linear",
    "mlx_lm.models.jamba",
    "mlx_lm.models.nemotron-nas",
    "mlx_lm.models.olmo_hybrid",
}


class DenseStore:
    block_size = KV_STEP  # the step mlx-lm's caches grow by
    geometry = None  # no paged layout
    key_bucket = 0  # mlx-lm's caches give SDPA keys of their own lengths (engine.kv.buckets)

    def __init__(self, model: Any, layout: CacheLayout, *, chunk_tokens: int) -> None:
        self.model = model
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.key_lengths = KeyLengths()  # exact always: bucket 0
        self.block_bytes = self.block_size * layout.bytes_per_token
        self.requests: dict[str, DenseAllocation] = {}
        self.rows: list[str] = []  # the decode batch's rows, in order
        self.batch: list[Any] | None = None  # merged caches of those rows (when `merges`)
        self._joining: list[DenseAllocation] = []  # rows joined, not yet merged into `batch`
        self.merges = (layout.mergeable and layout.batched
                       and type(model).__module__ not in UNPADDABLE)
        # prompts beginning together may share a prefill call (`DenseRunner.prefill`)
        self.batches_prefill = self.merges and type(model).__module__ not in UNPADDED_PREFILL
        # a token of left padding in a merged batch: every full entry's keys and values
        self._padded_bytes_per_token = sum(c.bytes_per_token for c in layout.layers if c.held_as == FULL)

    # ---- sizes -----------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-max(tokens, 1) // self.block_size)

    def reservation_bytes(self, tokens: int) -> int:
        """What a request of `tokens` (prompt + max_tokens) holds at most."""
        return self.layout.bytes_for(tokens, self.chunk_tokens)

    def rows_reservation_bytes(self, final_lens: Iterable[int]) -> int:
        """What requests of these final lengths hold at most together: each its own
        reservation, and where rows merge into the decode batch, the left padding that
        lengthens every row's full layers to the longest row's tokens."""
        lens = list(final_lens)
        own = sum(self.reservation_bytes(n) for n in lens)
        if not self.merges or len(lens) < 2:
            return own
        return own + self._padded_bytes_per_token * sum(max(lens) - n for n in lens)

    def growth_bytes(self, tokens: int, shared: SharedPrefix | None = None, *, exact: bool = False) -> int:
        """All of it is new (mlx-lm's caches allocate as they grow), and its row may lengthen
        the batch's padding: what the requests held grows by that."""
        held = [a.tokens for a in self.requests.values()]
        return self.rows_reservation_bytes([*held, tokens]) - self.rows_reservation_bytes(held)

    # ---- requests --------------------------------------------------------------------
    def reserve(
        self, request_id: str, tokens: int, shared: SharedPrefix | None = None, *, exact: bool = False
    ) -> DenseAllocation:
        if request_id in self.requests:
            raise ValueError(f"request {request_id} already holds KV")
        from mlx_lm.models.cache import make_prompt_cache

        if isinstance(shared, Snapshot):
            alloc = DenseAllocation(request_id, tokens, restore(shared), length=shared.tokens)
        else:
            alloc = DenseAllocation(request_id, tokens, make_prompt_cache(self.model))
        self.requests[request_id] = alloc
        return alloc

    def get(self, request_id: str) -> DenseAllocation:
        return self.requests[request_id]

    def advance(self, request_id: str, tokens: int) -> None:
        alloc = self.requests[request_id]
        alloc.length += tokens
        if alloc.length > alloc.tokens:
            raise RuntimeError(f"request {request_id} outgrew its reservation")

    def release(self, request_id: str) -> None:
        if request_id in self.rows:
            self.leave([request_id])
        self.requests.pop(request_id, None)

    # ---- the decode batch ------------------------------------------------------------
    def join(self, request_id: str) -> None:
        """The request's caches become the batch's last row (merged where they can be, at
        the batch's next use: `merged_batch`)."""
        alloc = self.requests[request_id]
        alloc.in_batch = True
        self.rows.append(request_id)
        if self.merges:
            assert alloc.caches is not None
            self._joining.append(alloc)

    def merged_batch(self) -> list[Any] | None:
        """The batch's caches, every row that joined since the last use merged in. Rows that
        joined together (prompts that finished prefill in the same step) are merged with one
        `merge` per layer and appended with one `extend`: each `extend` copies the whole
        batch's KV, so joining them one by one copied it once per row."""
        if self._joining:
            rows = merge_caches([a.caches for a in self._joining])
            for alloc in self._joining:
                alloc.caches = None
            self._joining = []
            if self.batch is None:
                self.batch = rows
            else:
                for batch_cache, row_cache in zip(self.batch, rows, strict=True):
                    batch_cache.extend(row_cache)
        return self.batch

    def leave(self, request_ids: list[str]) -> None:
        self.merged_batch()
        gone = set(request_ids)
        keep = [i for i, r in enumerate(self.rows) if r not in gone]
        if len(keep) == len(self.rows):
            return
        if self.batch is not None:  # the rows' own caches, for `hold_prefix` until released
            for i, r in enumerate(self.rows):
                if r in gone and r in self.requests:
                    self.requests[r].caches = _extract_row(self.batch, i)
        self.rows = [self.rows[i] for i in keep]
        for r in request_ids:
            if r in self.requests:
                self.requests[r].in_batch = False
        if self.batch is None:
            return
        if not keep:
            self.batch = None
            return
        for c in self.batch:
            c.filter(keep)

    # ---- the prefix cache's holds: snapshots ------------------------------------------
    def hold_prefix(self, request_id: str, tokens: int) -> SharedPrefix | None:
        """A snapshot of the request's caches, when they hold exactly `tokens` tokens (none
        of these caches can be cut back to fewer)."""
        alloc = self.requests.get(request_id)
        if alloc is None or alloc.caches is None or alloc.length != tokens or tokens <= 0:
            return None
        return take_snapshot(alloc.caches, tokens)

    def drop_prefix(self, prefix: SharedPrefix) -> None:
        return None

    # ---- accounting ------------------------------------------------------------------
    def reserved_bytes(self) -> int:
        return self.rows_reservation_bytes(a.tokens for a in self.requests.values())

    def request_bytes(self) -> int:
        """What the requests' caches hold now, their arrays' bytes."""
        return sum(c.nbytes for c in self._caches())

    def pool_bytes(self) -> int:
        return self.request_bytes()

    def freeable_bytes(self, prefixes: list[SharedPrefix]) -> int:
        return 0

    def kind_bytes(self) -> dict[str, int]:
        """Bytes held now, by cache kind ("full", "window", "state", ...)."""
        out: dict[str, int] = {}
        n = len(self.layout.layers)
        for i, cache in enumerate(self._caches()):
            kind = self.layout.layers[i % n].kind
            out[kind] = out.get(kind, 0) + cache.nbytes
        return out

    def stats(self) -> KVStoreStats:
        used = sum(self.layout.bytes_used(a.length) for a in self.requests.values() if a.length)
        held = self.request_bytes()
        return KVStoreStats(
            reserved_bytes=self.reserved_bytes(),
            used_bytes=used,
            pool_bytes=held,
            request_bytes=held,
            bytes_per_token=self.layout.bytes_per_token,
            block_size=self.block_size,
            segments=0,
            requests=len(self.requests),
        )

    def _caches(self) -> Iterator[Any]:
        """Every leaf cache object held (a `CacheList`'s children), in layout order per
        request and then for the batch."""
        for a in self.requests.values():
            if a.caches is not None:
                yield from _leaves(a.caches)
        if self.batch is not None:
            yield from _leaves(self.batch)


def merge_caches(rows: list[list[Any]]) -> list[Any]:
    """Requests' caches (one list per request, one cache per layer) as one batch: each
    layer's `merge` (mlx-lm's batch caches, rows left-padded to the longest)."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*rows, strict=True)]


def _leaves(caches: list[Any]) -> Iterator[Any]:
    from mlx_lm.models.cache import CacheList

    for c in caches:
        if isinstance(c, CacheList):
            yield from _leaves(list(c.caches))
        else:
            yield c


def _extract_row(batch: list[Any], row: int) -> list[Any] | None:
    """Row `row`'s own caches out of the merged batch; None when a layer's cache was never
    written (nemotron-nas's no-op attention layers: mlx-lm's `extract` cannot cut keys that
    do not exist), and then the row leaves no snapshot."""
    try:
        return [c.extract(row) for c in batch]
    except TypeError:
        return None
