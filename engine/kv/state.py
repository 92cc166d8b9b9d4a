"""Recurrent state beside the paged store: a hybrid's `ArraysCache` entries, per request.

Hybrids (Qwen3-Next, Qwen3.5, LFM2, Nemotron-H, Jamba, Granite-MoE-Hybrid, Kimi-Linear…)
interleave attention layers, whose KV the paged store holds in blocks, with layers that
carry a fixed-size state per sequence (a convolution window, an SSM or delta-net state):
mlx-lm's `ArraysCache`. State has no tokens to page; it is one slot per sequence per state
entry, replaced whole by every call. So the store keeps blocks for the attention layers
(`KVGeometry.states` maps the model's cache entries onto them) and this module keeps the
state, as mlx-lm's `BatchGenerator` does:

- while a request prefills, its own caches, a batch of one (prefill runs one prompt per
  call: rows padded to a common length would run their padding through the state);
- when it joins the decode batch, its rows are appended to the batch's caches
  (`ArraysCache.extend`), in the runner's row order, and taken out when rows leave
  (`ArraysCache.filter`): the state's only copies, a few MiB per row, where the paged
  store copies no KV at all;
- a snapshot is the arrays themselves. MLX arrays are values and a call writes new ones,
  so holding a reference is a copy that costs nothing until the request moves on (the
  dense path's snapshots rely on the same, `engine.dense.prefix`). The prefix cache keeps
  snapshots on its nodes (`SharedPrefix.state`): a hit resumes only where one exists.

Admission counts a request's state as a fixed cost (`KVGeometry.state_bytes`), and
speculative decoding is off (state cannot be rolled back to a rejected draft). A traced
decode step (`engine.compiled_decode`) takes the batch's state arrays as inputs and gives
them back updated, as it does the pool's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

if TYPE_CHECKING:  # mlx-lm is imported where a model is loaded, not with the server
    from mlx_lm.models.cache import ArraysCache

Snapshot = tuple[tuple[mx.array | None, ...], ...]  # per state entry, its arrays for one row


class StateRows:
    def __init__(self, states: tuple[bool, ...], make: Callable[[], list[ArraysCache]]) -> None:
        self.states = states  # per model cache entry: a state entry (True) or a KV layer
        self._make = make  # fresh caches of every state entry, for one sequence
        self.own: dict[str, list[ArraysCache]] = {}  # requests not in the decode batch
        self.batch: list[ArraysCache] | None = None  # the decode batch's, rows in its order

    def fresh(self) -> list[ArraysCache]:
        """New, empty caches of every state entry (a traced step fills them)."""
        return self._make()

    def of(self, request_id: str) -> list[ArraysCache]:
        """The request's own caches (new ones for a request starting from nothing)."""
        caches = self.own.get(request_id)
        if caches is None:
            caches = self.own[request_id] = self._make()
        return caches

    def resume(self, request_id: str, snapshot: Snapshot) -> None:
        """The request starts from a snapshot: new cache objects over its arrays."""
        caches = self._make()
        for cache, arrays in zip(caches, snapshot, strict=True):
            cache.cache = list(arrays)
        self.own[request_id] = caches

    def snapshot(self, request_id: str) -> Snapshot:
        """The request's own state now (before it joins the batch)."""
        return tuple(tuple(c.cache) for c in self.own[request_id])

    def arrays(self, request_id: str) -> list[mx.array]:
        """The request's own state arrays (to evaluate with its call)."""
        return [a for c in self.own.get(request_id, ()) for a in c.cache if a is not None]

    def row(self, index: int) -> Snapshot:
        """Row `index` of the decode batch's state now."""
        assert self.batch is not None
        return tuple(tuple(None if a is None else a[index : index + 1] for a in c.cache) for c in self.batch)

    def join(self, request_id: str) -> None:
        """The request's state becomes the decode batch's last row."""
        caches = self.of(request_id)  # new ones for a prompt of one token: nothing prefilled
        del self.own[request_id]
        if self.batch is None:
            self.batch = caches
            return
        for batch, row in zip(self.batch, caches, strict=True):
            batch.extend(row)

    def keep(self, rows: list[int]) -> None:
        """Only these rows of the decode batch stay, in this order."""
        if self.batch is None:
            return
        if not rows:
            self.batch = None
            return
        index = mx.array(rows)
        for cache in self.batch:
            cache.filter(index)

    def drop(self, request_id: str) -> None:
        """A request that leaves before it joins the batch."""
        self.own.pop(request_id, None)

    def caches(self, kv: Sequence[Any], states: Sequence[ArraysCache]) -> list[Any]:
        """The model's cache list: its KV layers' caches (in order) at the KV entries, the
        state caches at the state entries."""
        kv_it, state_it = iter(kv), iter(states)
        return [next(state_it) if state else next(kv_it) for state in self.states]


def make_state_caches(model: Any, states: tuple[bool, ...]) -> Callable[[], list[ArraysCache]]:
    """What `StateRows` builds a sequence's state caches with: the model's own."""
    from mlx_lm.models.cache import make_prompt_cache

    def make() -> list[ArraysCache]:
        return [c for c, state in zip(make_prompt_cache(model), states, strict=True) if state]

    return make
