"""MLX settings read from the environment, defaulted for a long-lived server before MLX loads.

MLX's CUDA backend keeps LRU caches of cuDNN attention plans (`MLX_CUDA_SDPA_CACHE_SIZE`,
256), captured CUDA graphs (`MLX_CUDA_GRAPH_CACHE_SIZE`, 400) and others, and counts every
miss over the process's life: past twice a cache's capacity it raises "Cache thrashing is
happening" on the next miss (mlx/backend/cuda/lru_cache.h), and where that happens off the
calling thread the process aborts. The count is never reset, not by a hit nor by eviction,
so any server that sees many prompt lengths crosses it in time: each prefill call's shape
(its rows, queries, keys) is a plan of its own, and the engine pays for new shapes knowingly
(`engine/kv/buckets.py`). A miss costs that plan (about 35 ms), never correctness, so the
check is turned off (`MLX_ENABLE_CACHE_THRASHING_CHECK=0`) unless the operator sets it.
Other projects serving MLX on CUDA met the same abort (lablup/mlxcel#818, #1031).

The variable is read when each cache is built, on first use: it must be in the environment
before MLX runs anything, so `serve` sets it first (`server.cli.main`), and the processes it
starts (a jemalloc re-execution, tensor-parallel ranks) inherit it.
"""

from __future__ import annotations

from collections.abc import MutableMapping

DEFAULTS = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}


def apply_defaults(environ: MutableMapping[str, str]) -> None:
    """Set each default the environment does not already set."""
    for name, value in DEFAULTS.items():
        environ.setdefault(name, value)


def reported(environ: MutableMapping[str, str]) -> dict[str, str | None]:
    """The values this process runs with, for `/v1/version`."""
    return {name: environ.get(name) for name in DEFAULTS}
