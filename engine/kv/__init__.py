"""The engine's KV store: paged blocks allocated per request, and attention over them.

    store.py        segments, block tables, reservations, prefix holds, bytes
    blocks.py       free lists and reference counts (pure Python)
    cache.py        the per-layer cache objects mlx-lm's model code calls
    prefill.py      batched prefill: several requests' chunks in one right-padded call
    quant.py        quantized KV rows (`--kv-bits`): packed values, scales and biases
    attention.py    the rebound attention: CUDA kernel or plain-MLX fallback
    cuda_decode.py  the paged decode kernel (`mx.fast.cuda_kernel`)
    device_vectors.py  per-step index vectors kept out of CUDA's host scalar pool

`docs/kv-store.md` explains the design and its measurements.
"""

from engine.kv.attention import install_attention_hook, kernel_active, use_kernel
from engine.kv.cache import DecodePlan, decode_caches, plan_decode, prefill_caches
from engine.kv.store import Allocation, KVGeometry, KVStore, KVStoreStats, SharedPrefix

__all__ = [
    "Allocation",
    "DecodePlan",
    "KVGeometry",
    "KVStore",
    "KVStoreStats",
    "SharedPrefix",
    "decode_caches",
    "install_attention_hook",
    "kernel_active",
    "plan_decode",
    "prefill_caches",
    "use_kernel",
]
