"""What a decode step holds beside the store while it attends: the batch's gathered K/V.

Where decode attention does not read the pool in place, each layer gathers its rows' K/V
into one contiguous [rows, heads, longest, dim] array (`engine.kv.attention.plain_decode`:
the CPU, Metal, quantized KV; and the gather path of models that attend with their own
code, `KVGeometry.gather`, on every backend). Those arrays are transients of the step,
not of the store, and they grow with rows × the longest row: at 32 rows of 4k tokens of an
8B model, 512 MiB per layer. Admission asks the guard for them when a request joins the
batch (`engine.admission.Admission`), or a batch that fits at rest could overrun the
ceiling mid-step, which on Apple Silicon may panic the machine instead of raising.

How many layers' gathers are alive at once depends on how MLX runs the step. On the CPU
each op runs as it is reached and a layer's gather is freed when its attention is done:
one layer (measured: 65 MiB above the resting footprint for a 64 MiB layer gather at 8 rows
× 2,048 tokens; `tests/engine/test_decode_transient.py` checks 8 rows × 1,088). On a GPU a whole step is
encoded before it completes and a buffer is returned only when the work that used it has
finished: the H200's plain path peaked at 3,982 MiB above rest at 32 rows of 1k tokens, 31
of its 32 layers' gathers (`docs/kv-store.md`). So on a GPU every gathering layer counts.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx

from engine.kv.attention import decode_reads_in_place
from engine.kv.store import KVStore


def layers_in_flight(num_layers: int) -> int:
    """Layers whose decode transients coexist: one on the CPU, all on a GPU (see above)."""
    return 1 if mx.default_device().type == mx.cpu else num_layers


def decode_gather_bytes(store: KVStore, final_lens: Iterable[int]) -> int:
    """The gathered K/V of one decode step of rows of these final lengths (each row padded
    to the longest in a gather), at its largest: every row at its final length."""
    lens = list(final_lens)
    if not lens:
        return 0
    geo = store.geometry
    quant = geo.quant
    (heads, width), dtype = geo.row_shape
    (_, value_width), value_dtype = geo.value_row_shape
    per_token = heads * (width * dtype.size + value_width * value_dtype.size)  # as the pool holds it
    if quant is not None:  # decoded to the model's dtype beside the packed rows
        per_token += 2 * geo.num_kv_heads * geo.head_dim * geo.dtype.size
    longest = max(lens)
    per_layer = []
    for group, blocks in zip(geo.groups, store.group_blocks(longest), strict=True):
        if decode_reads_in_place(geo, group.window):
            continue
        per_layer += [len(lens) * blocks * store.block_size * per_token] * len(group.layers)
    per_layer.sort(reverse=True)
    return sum(per_layer[: layers_in_flight(geo.num_layers)])
