"""Decode steps replayed from a traced graph (`mx.compile`) once the batch's shape holds still.

On by default on CUDA only (`EngineConfig.compile_decode`, `engine.loader.on_cuda_by_default`). Before
the projections were fused, the server's A/B on the H200 stayed inside run-to-run noise; once
they were (`engine.fusion`), an interleaved server A/B (eager, compiled, eager, compiled, each a
fresh server) had compiled ahead in all 8 pairs: C=1 99-115 against 133-149 tok/s, C=32
1,517-1,777 against 1,776-2,092, steady TPOT at C=32 13.9-14.9 against 9.8-12.0 ms
(docs/throughput.md). The CPU and Metal were not measured, so they stay eager.

Why it was tried: on CUDA the decode step is host-bound. The model's Python builds ~1,650 ops per step
for an 8B model and MLX encodes each, while the device waits about 0.1 ms per step
(`docs/throughput.md`). A compiled step skips the Python and fuses elementwise ops:
an in-process A/B measured 11.25 against 9.28 ms per step at batch 32 on the H200,
with the same tokens and the same peak memory.

What is traced. The model's forward over the step's rows, as a pure function of the step's
arrays (each group's write slots, block tables, lengths and window rings, whatever the
segments and layer groups) and its segments' layer arrays, which it returns updated:
the KV writes stay in place, because the caller drops its references to the old arrays
before the step is evaluated. Sampling stays eager.

When. A traced graph is only valid for the shapes and Python values it was built with:
the batch size, the block table's width, and how attention splits the context
(`engine.kv.attention.decode_graph_key`). A join or a leave changes the batch size, and
tracing costs about one eager step's host work, so a shape is traced only after it has
held for `after` consecutive steps; ramps (requests joining and leaving one by one) run
eagerly. Traced graphs are kept per shape, the `keep` most recent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.kv import KVStore, decode_caches
from engine.kv.attention import decode_graph_key
from engine.kv.cache import DecodeGroup, DecodePlan
from engine.kv.state import StateRows

GraphKey = tuple[Any, ...]


class CompiledDecode:
    def __init__(self, model: Any, store: KVStore, q_heads: int, *, after: int = 4, keep: int = 32) -> None:
        self.model = model
        self.store = store
        self.q_heads = q_heads
        self.after = max(after, 1)
        self.keep = max(keep, 1)
        self.graphs: OrderedDict[GraphKey, Callable[..., tuple[mx.array, ...]]] = OrderedDict()
        self.traces = 0  # graphs built so far (a shape evicted and seen again counts twice)
        self.replays = 0  # steps answered by a traced graph, the trace's own step included
        self._last: GraphKey | None = None
        self._streak = 0

    def logits(self, plan: DecodePlan, inputs: mx.array, states: StateRows | None = None) -> mx.array | None:
        """The step's [B, vocab] logits from a traced graph, or None: run this step eagerly.
        With a hybrid's `states`, the batch's state arrays are inputs of the step too, and
        come back updated."""
        groups = plan.all_groups()
        state = [] if states is None or states.batch is None else [c.cache for c in states.batch]
        # One row read as a slice of the pool, whose length is in the graph's shapes
        # (engine.kv.attention.run_decode), or a state not yet made: left eager.
        if any(g.run_start is not None for g in groups) or any(a is None for c in state for a in c):
            self._last = None
            return None
        segments = list({id(g.segment): g.segment for g in groups}.values())
        where = {id(seg): i for i, seg in enumerate(segments)}
        geo = self.store.geometry
        specs = tuple(_GroupSpec(where[id(g.segment)], g.rows is not None, g.window, g.ring is not None,
                                 g.max_length) for g in groups)
        key = (tuple(seg.id for seg in segments), inputs.shape[0], plan.order is not None,
               plan.layout(), tuple(len(c) for c in state), *(
                   (spec.segment, spec.rows, g.write.shape[0], g.table.shape[1], g.window, spec.ring,
                    *decode_graph_key(g, self.q_heads, geo.head_dim, geo.num_kv_heads, plan.block_size,
                                      geo.quant))
                   for spec, g in zip(specs, groups, strict=True)))
        self._streak = self._streak + 1 if key == self._last else 1
        self._last = key
        fn = self.graphs.get(key)
        if fn is None:
            if self._streak < self.after:
                return None
            fn = self.graphs[key] = mx.compile(self._forward(
                specs, plan.layout(), tuple(len(seg.keys) for seg in segments), plan.order is not None,
                plan.block_size, tuple(len(c) for c in state), states))
            self.traces += 1
            if len(self.graphs) > self.keep:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        arrays = [] if plan.order is None else [plan.order]
        for g in groups:
            arrays += [] if g.rows is None else [g.rows]
            arrays += [g.write, g.table, g.lengths]
            arrays += [] if g.ring is None else [g.ring, g.ring_blocks]
        pool = [a for seg in segments for a in (*seg.keys, *seg.values)]
        out = fn(inputs, plan.offsets, *arrays, *pool, *(a for c in state for a in c))
        at = 1
        for seg in segments:
            n = len(seg.keys)
            seg.keys[:] = out[at : at + n]
            seg.values[:] = out[at + n : at + 2 * n]
            at += 2 * n
        for arrays_of_entry in state:
            arrays_of_entry[:] = out[at : at + len(arrays_of_entry)]
            at += len(arrays_of_entry)
        self.replays += 1
        return out[0]

    def _forward(self, specs: tuple[_GroupSpec, ...], layout: tuple[int, ...],
                 segment_layers: tuple[int, ...], ordered: bool, block_size: int,
                 state_sizes: tuple[int, ...] = (),
                 states: StateRows | None = None) -> Callable[..., tuple[mx.array, ...]]:
        """The step as a function of arrays only: the plan's groups (in `layout`'s layer
        groups), rebuilt from their arrays over stand-ins for the segments. Each group's
        `max_length` reaches the graph only through the graph key, so any step with this key
        may replay it. The closure holds no segment: a kept graph must not keep a released
        segment's arrays alive."""
        model, geo = self.model, self.store.geometry
        layers, quant = geo.num_layers, geo.quant
        slots = geo.layer_slots if len(geo.groups) > 1 else ()

        def forward(tokens: mx.array, offsets: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
            it = iter(arrays)
            order = next(it) if ordered else None
            taken = []
            for spec in specs:
                rows = next(it) if spec.rows else None
                write, table, lengths = next(it), next(it), next(it)
                ring, ring_blocks = (next(it), next(it)) if spec.ring else (None, None)
                taken.append((spec, rows, write, table, lengths, ring, ring_blocks))
            pools = []
            for n in segment_layers:
                keys = [next(it) for _ in range(n)]
                pools.append(_Pool(keys, [next(it) for _ in range(n)]))
            built = [DecodeGroup(pools[spec.segment], rows, write, table, lengths,  # type: ignore[arg-type]
                                 spec.max_length, window=spec.window, ring=ring, ring_blocks=ring_blocks)
                     for spec, rows, write, table, lengths, ring, ring_blocks in taken]
            per_group, at = [], 0
            for count in layout:
                per_group.append(built[at : at + count])
                at += count
            plan = DecodePlan(per_group[0], offsets, order, block_size, quant, tuple(per_group[1:]), slots)
            caches: list[Any] = decode_caches(plan, layers)
            traced_states = []
            if states is not None:  # the batch's state caches, over the traced arrays
                traced_states = states.fresh()
                for cache, n in zip(traced_states, state_sizes, strict=True):
                    cache.cache = [next(it) for _ in range(n)]
                caches = states.caches(caches, traced_states)
            logits = model(tokens[:, None], cache=caches)[:, -1, :]
            return (logits, *(a for p in pools for a in (*p.keys, *p.values)),
                    *(a for c in traced_states for a in c.cache))

        return forward


@dataclass(frozen=True)
class _GroupSpec:
    """What a traced step knows of one of its groups besides the arrays: which segment it
    lives in, whether it names its rows, its window and ring, and its longest row."""

    segment: int
    rows: bool
    window: int | None
    ring: bool
    max_length: int


@dataclass
class _Pool:
    """The traced stand-in for a segment: what the decode caches and attention read."""

    keys: list[mx.array]
    values: list[mx.array]
