"""Plan the next prefill chunk's attention while the device runs this one.

On CUDA each new shape of prefill attention costs a plan (cuDNN builds one per shape of its
inputs, `engine.kv.buckets`): host work of 35-65 ms (H100, H200) inside the call that first
runs the shape. A long prompt prefilled beside decoding streams runs chunks of a few hundred
tokens, each over a key length it has never seen. `KeyLengths` pads those keys to a bucket
so that most chunks reuse a plan, but the padding takes attention off cuDNN's causal path
(1.85-2x its time at 98k keys), and each new bucket still pays its plan in the step that
crosses it: on the H100, steps of 75-120 ms at 45k-97k of context, with one in every eight
at 130-250 ms, the streams' p99 gap.

The next chunk's shape is known while this one runs: the same rows and queries, its keys
`tokens` further on. So once this chunk is queued, the runner queues one layer's attention
at that shape (`plan_ahead`): its plan is built on the host while the device is still busy
with the chunk, and its kernel costs one layer's attention. The next chunk then attends its
exact keys (`KeyLengths.planned`), causal and already planned. It runs where the part of
the plan that the chunk's time on the device does not hide costs less than padding the
next chunk would (`KeyLengths.ahead_pays`, against the last chunk's time), and only for a
lone request read as a view of the pool: the plan is keyed by the inputs' strides too, and
the warm-up must build exactly what the next call will use. `python -m bench.plan_check`
checks that premise on a GPU (on an H100, a chunk planned ahead took 0.6-1.4 ms, what a
planned shape takes, where a new exact shape took 40-63 ms).
"""

from __future__ import annotations

import mlx.core as mx

from engine.kv.blocks import consecutive
from engine.kv.buckets import padded_keys
from engine.kv.cache import PrefillCache, run_view
from engine.kv.store import Allocation, KVStore


def plan_ahead(store: KVStore, alloc: Allocation, caches: list[PrefillCache], tokens: int) -> mx.array | None:
    """Queue-ready attention over the next chunk's exact shape (`tokens` more queries, its
    keys `tokens` further on), read from where the next call will read it; None where no
    plan is needed or the next call would not match it. Evaluating the result plans the
    shape, and the store's `KeyLengths` then takes exact keys for it."""
    cache = next((c for c in caches if c.call is not None), None)
    if cache is None or cache.run_start is None or not store.prefill_views:
        return None
    queries, scale, mask, sinks = cache.call
    if not (isinstance(mask, str) and mask == "causal") and mask is not cache.padded_mask:
        return None  # a mask of the model's own: its next call is not the causal one planned here
    lengths = store.key_lengths
    end = cache.offset + tokens
    if padded_keys(end, lengths.bucket) == end or lengths.is_planned(tokens, end):
        return None  # a length the bucket pads to anyway, or planned already
    blocks = store.blocks_for(end)
    table = alloc.table
    if len(table) < blocks or not consecutive(table[:blocks]) \
            or cache.run_start + end > alloc.segment.slots:
        return None  # the next call gathers its keys (other strides): a plan of no use
    seg = cache.segment
    keys, values = run_view(seg.keys[cache.layer], seg.values[cache.layer], cache.run_start, end, cache.quant)
    lengths.planned(tokens, end)
    lengths.planned_ahead += 1
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal",
                                                sinks=sinks)
