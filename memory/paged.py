"""How the paged KV store holds a model whose layers attend over different spans.

A model with full-attention layers and sliding-window layers (Gemma 3, gpt-oss, Cohere 2)
is held the way vLLM's hybrid allocator holds it: the layers are split into *groups of
equal size*, each group holding layers of one kind, and a block of the store holds
``block`` tokens of one group's layers. Every group draws its blocks from the same pool,
so memory moves freely between kinds, and each request keeps one block table per group:

- a full group takes a block for every ``block`` tokens of the request, as a model of full
  layers only does (that model is the case of one group);
- a window group takes a *ring*: enough blocks for the window plus the largest chunk that
  is written at once (a prefill chunk, a speculative verify), never more, however long the
  request (`ring_blocks`). Position ``p`` lives in ring block ``(p // block) % blocks``.

The group size is the number of full layers (all of a model's full layers share one
table, which is what a prefix hit shares); window layers fill groups of that size, the
last one possibly part empty. The empty slots are memory the store holds and counts.

Nothing here imports MLX: the engine's store (`engine.kv.store`) and load admission
(`memory.walk`) both size a request with these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Copies of the rings (prefix-cache resume points) a new segment has room for besides its
# request: the prompt's end and the conversation's end (`KVStore.hold_prefix`).
SNAPSHOTS_PER_SEGMENT = 2


@dataclass(frozen=True)
class PagedGroup:
    """Layers of one kind that share block tables: `layers` in slot order."""

    layers: tuple[int, ...]
    window: int | None = None  # keys a query attends, itself included; None: every earlier key


def group_layers(windows: Sequence[int | None]) -> tuple[PagedGroup, ...]:
    """Groups for a model whose layer ``i`` attends over ``windows[i]`` keys (None: full).
    Full layers first, as one group; each window's layers in groups of the same size."""
    full = tuple(i for i, w in enumerate(windows) if w is None)
    by_window: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        if w is not None:
            by_window.setdefault(w, []).append(i)
    size = len(full) or max((len(v) for v in by_window.values()), default=0)
    groups = [PagedGroup(full)] if full else []
    for window, layers in sorted(by_window.items()):
        groups += [PagedGroup(tuple(layers[k : k + size]), window) for k in range(0, len(layers), size)]
    return tuple(groups)


def ring_blocks(window: int, chunk: int, block: int) -> int:
    """Blocks in a window group's ring. A call of ``chunk`` tokens writes them first and
    then reads from ``window - 1`` positions before its first: those ``window - 1 + chunk``
    consecutive positions must sit in distinct slots, so the write never overwrites a key
    a query of the same call still needs."""
    return -(-(window - 1 + max(chunk, 1)) // block)


def snapshot_blocks(groups: Sequence[PagedGroup], block: int) -> int:
    """Blocks one copy of the rings takes: per window group, the widest window's positions
    before a resume point, from up to a block earlier, over whole blocks."""
    windows = [g.window for g in groups if g.window is not None]
    if not windows:
        return 0
    span = max(windows) - 1 + block - 1
    return len(windows) * (-(-span // block) + 1)


def snapshot_spare(groups: Sequence[PagedGroup], block: int) -> int:
    """Blocks a new segment keeps beside its request for `SNAPSHOTS_PER_SEGMENT` copies of
    its rings (0 without window groups)."""
    return SNAPSHOTS_PER_SEGMENT * snapshot_blocks(groups, block)


def group_blocks(group: PagedGroup, tokens: int, block: int, chunk: int) -> int:
    """Blocks a request of ``tokens`` holds in ``group``."""
    need = -(-max(tokens, 1) // block)
    return need if group.window is None else min(need, ring_blocks(group.window, chunk, block))


@dataclass(frozen=True)
class PagedLayout:
    """A model's groups and the bytes of one token of one layer (keys and values)."""

    groups: tuple[PagedGroup, ...]
    layer_bytes_per_token: int

    @property
    def slots(self) -> int:
        """Layers a block holds: the largest group's size."""
        return max(len(g.layers) for g in self.groups)

    @property
    def block_bytes_per_token(self) -> int:
        """Bytes of one token slot of a block (`slots` layers): what the store's segment
        sizes divide by."""
        return self.slots * self.layer_bytes_per_token

    @property
    def blocks_per_layout(self) -> int:
        """How many groups' blocks hold what one block of every layer would: a segment of a
        given number of tokens holds this many times fewer of them."""
        layers = sum(len(g.layers) for g in self.groups)
        return -(-layers // self.slots)

    def blocks_for(self, tokens: int, block: int, chunk: int) -> int:
        return sum(group_blocks(g, tokens, block, chunk) for g in self.groups)

    def segment_blocks(self, need: int, block: int) -> int:
        """A new segment's blocks for a request of `need` blocks: with room for copies of its
        rings beside it (`snapshot_spare`)."""
        return need + snapshot_spare(self.groups, block)

    def bytes_for(self, tokens: int, block: int, chunk: int) -> int:
        """What a request of ``tokens`` reserves: its blocks in every group."""
        return self.blocks_for(tokens, block, chunk) * block * self.slots * self.layer_bytes_per_token


def paged_layout(windows: Sequence[int | None], layer_bytes_per_token: int) -> PagedLayout:
    return PagedLayout(group_layers(windows), layer_bytes_per_token)
