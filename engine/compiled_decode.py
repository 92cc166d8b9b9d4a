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

What is traced. The model's forward over one group of rows (one KV segment), as a pure
function of the step's arrays and the segment's layer arrays, which it returns updated:
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

    def logits(self, plan: DecodePlan, inputs: mx.array) -> mx.array | None:
        """The step's [B, vocab] logits from a traced graph, or None: run this step eagerly."""
        # Rows in several segments (rare), or one row read as a slice of the pool, whose
        # length is in the graph's shapes (engine.kv.attention.run_decode): left eager.
        if len(plan.groups) != 1 or plan.groups[0].run_start is not None:
            self._last = None
            return None
        (g,) = plan.groups
        geo = self.store.geometry
        key = (g.segment.id, inputs.shape[0], g.table.shape[1],
               *decode_graph_key(g, self.q_heads, geo.head_dim, geo.num_kv_heads, plan.block_size,
                                 geo.quant))
        self._streak = self._streak + 1 if key == self._last else 1
        self._last = key
        fn = self.graphs.get(key)
        if fn is None:
            if self._streak < self.after:
                return None
            fn = self.graphs[key] = mx.compile(self._forward(g.max_length, plan.block_size))
            self.traces += 1
            if len(self.graphs) > self.keep:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        seg = g.segment
        layers = geo.num_layers
        out = fn(inputs, g.write, g.table, g.lengths, plan.offsets, *seg.keys, *seg.values)
        seg.keys[:] = out[1 : 1 + layers]
        seg.values[:] = out[1 + layers :]
        self.replays += 1
        return out[0]

    def _forward(self, max_length: int, block_size: int) -> Callable[..., tuple[mx.array, ...]]:
        """The step as a function of arrays only. `max_length` reaches the graph only
        through the graph key, so any step with this key may replay it. The closure holds
        no segment: a kept graph must not keep a released segment's arrays alive."""
        model, layers, quant = self.model, self.store.geometry.num_layers, self.store.geometry.quant

        def forward(tokens: mx.array, write: mx.array, table: mx.array, lengths: mx.array,
                    offsets: mx.array, *pool: mx.array) -> tuple[mx.array, ...]:
            traced = _Pool(list(pool[:layers]), list(pool[layers:]))
            group = DecodeGroup(traced, None, write, table, lengths, max_length)  # type: ignore[arg-type]
            caches = decode_caches(DecodePlan([group], offsets, None, block_size, quant), layers)
            logits = model(tokens[:, None], cache=caches)[:, -1, :]
            return (logits, *traced.keys, *traced.values)

        return forward


@dataclass
class _Pool:
    """The traced stand-in for a segment: what the decode caches and attention read."""

    keys: list[mx.array]
    values: list[mx.array]
