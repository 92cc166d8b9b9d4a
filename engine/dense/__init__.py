"""Serving models whose caches the paged store cannot hold, through mlx-lm's own caches.

    store.py   each request's `make_prompt_cache` while it prefills, one merged batch
               cache for the decode rows; bytes counted from `engine.cache_layout`
    prefix.py  the prefix cache: snapshots of a sequence's caches at checkpoint boundaries,
               at the prompt's end and at the request's end, resumed by prompts extending them
    runner.py  prefill one request per call, decode the rows in one batched call (or
               one call per row where the store does not merge them), sampling as the
               paged runner does

`EngineCore` picks this pair when `CacheLayout.plain_kv` is False (sliding windows, sinks,
recurrent state, `CacheList`, chunked attention, MLA, rows that cannot batch) or when the
model's attention does not go through mlx-lm's `scaled_dot_product_attention`.
"""

from engine.dense.prefix import DensePrefixCache, Snapshot
from engine.dense.runner import DenseRunner
from engine.dense.store import DenseAllocation, DenseStore

__all__ = ["DenseAllocation", "DensePrefixCache", "DenseRunner", "DenseStore", "Snapshot"]
