"""Paged decode attention, and the hook that routes mlx-lm's attention to it.

mlx-lm's model files import `scaled_dot_product_attention` by name from
`mlx_lm.models.base`, so patching `base` reaches none of them. `install_attention_hook`
rebinds the name in each module that defines one of the model's layers; the rebound
function answers for a `DecodeCache` and hands every other cache (prefill chunks, other
engines' caches) to the original unchanged. Model files are not forked.

Backends. One group of rows (the rows living in one segment) is attended either by
the CUDA paged kernel (`engine.kv.cuda_decode`, reads the pool through block tables), or
by the plain-MLX fallback beside it: gather that group's slots for one layer, then one
masked `mx.fast.scaled_dot_product_attention`. A group of one row on consecutive blocks
(planned so by `DecodeTables(runs=True)`) is one unmasked SDPA over a slice of the pool
(`run_decode`). The fallback serves the CPU and Metal
(no Metal kernel ships yet), CUDA shapes the kernel does not take (head_dim not a multiple
of 32), and is the reference the kernel is tested against. Quantized KV
(`engine.kv.quant`) takes the plain path (or the slice), which decodes the gathered rows
to the queries' dtype before the SDPA; on CUDA the kernel's quantized variant, which
decodes each lane's values as it reads them, replaces it where `use_quant_kernel(True)`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx

from engine.kv.cache import DecodeCache, DecodeGroup, PrefillCache, pool_rows, run_view
from engine.kv.cuda_decode import decode_span, paged_decode, partition_split
from engine.kv.quant import KVQuant
from engine.kv.store import KVGeometry

_ORIGINAL: Callable[..., mx.array] | None = None  # mlx-lm's, looked up by `_original`
_kernel_enabled: bool | None = None
# The kernel's window (ring) and sinks variants: checked against the plain path on an H100
# (`python -m bench.kernel_check`: every case within bf16's tolerance, 7-11x faster at a
# batch of 32; bench/results/2026-12-07-h100-80gb-hbm3-kernel-check). Off: the plain path.
_window_kernel_enabled = True
# The kernel's quantized-KV variant: compiled here (NVRTC), not yet run against the plain
# path on a GPU (`python -m bench.kernel_check` does). Off: quantized KV takes the plain path.
_quant_kernel_enabled = False


def use_kernel(enabled: bool | None) -> None:
    """Force the CUDA kernel on or off (None: on whenever CUDA is the default device)."""
    global _kernel_enabled
    _kernel_enabled = enabled


def use_quant_kernel(enabled: bool) -> None:
    """Let the CUDA kernel read quantized KV rows in place (off by default), or keep them
    on the plain path, which gathers and decodes each layer's rows."""
    global _quant_kernel_enabled
    _quant_kernel_enabled = enabled


def use_window_kernel(enabled: bool) -> None:
    """Let the CUDA kernel attend window layers' rings and sinks (on by default), or keep
    them on the plain path (an A/B; `bench.kernel_check` compares the two)."""
    global _window_kernel_enabled
    _window_kernel_enabled = enabled


def kernel_active() -> bool:
    if _kernel_enabled is not None:
        return _kernel_enabled
    return bool(mx.cuda.is_available()) and mx.default_device().type == mx.gpu


def paged_scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    if isinstance(cache, DecodeCache):
        if cache.plan.gather:  # `keys`, `values` are every row's, gathered (DecodeCache)
            return _original()(queries, keys, values, cache=None, scale=scale,
                               mask=_written_only(mask, cache), sinks=sinks)
        return decode_attention(queries, cache, scale, sinks)
    if isinstance(cache, PrefillCache) and cache.records_call:
        cache.call = (queries, scale, mask, sinks)
    return _original()(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _written_only(mask: Any, cache: DecodeCache) -> mx.array:
    """A gathering decode step's mask (`KVGeometry.gather`): whatever the model made (its own
    score bias, as MLA's rotary scores, or none), with each row's unwritten keys masked out:
    a model that asked no mask for one query (mistral4) did not mask them itself."""
    written = cache.plan.length_mask(cache.groups)
    if mask is None or isinstance(mask, str):
        return written
    if mask.dtype == mx.bool_:
        return mask & written
    return mx.where(written, mask, mx.array(mx.finfo(mask.dtype).min, mask.dtype))


def decode_attention(queries: mx.array, cache: DecodeCache, scale: float,
                     sinks: mx.array | None = None) -> mx.array:
    """`queries` is [B, heads, 1, dim]; each row attends to its own blocks only (a window
    layer's row to its band of them), with gpt-oss's per-head `sinks` in the softmax."""
    plan = cache.plan
    outs = []
    for g in cache.groups:
        q = queries if g.rows is None else queries[g.rows]
        outs.append(_attend_group(q, g, cache.slot, scale, plan.block_size, plan.quant, sinks))
    if plan.order is None:
        return outs[0]
    return mx.concatenate(outs, axis=0)[plan.order]


def _attend_group(q: mx.array, g: DecodeGroup, slot: int, scale: float, block_size: int,
                  quant: KVQuant | None, sinks: mx.array | None = None) -> mx.array:
    keys, values = g.segment.keys[slot], g.segment.values[slot]
    if g.run_start is not None and g.ring is not None:
        return ring_run_decode(q, keys, values, g, scale, block_size, quant, sinks)
    if g.run_start is not None:
        return run_decode(q, keys, values, g.run_start, g.max_length, scale, quant, sinks)
    if g.kernel is None:  # decided once per step: every layer has the same shapes
        g.kernel = (_window_kernel_enabled or (g.ring is None and sinks is None)) and \
            _takes_kernel(q.shape[1], q.shape[-1], keys.shape[1], quant)
    if g.kernel:
        return paged_decode(q, keys, values, g.table, g.lengths, g.max_length, scale, block_size,
                            window=g.window, ring=g.ring_blocks, sinks=sinks, quant=quant)
    return plain_decode(q, keys, values, g, scale, block_size, quant, sinks)


def decode_reads_in_place(geometry: KVGeometry, window: int | None) -> bool:
    """Whether a decode step attends this group's layers straight from the pool (the CUDA
    kernel), rather than gathering each layer's rows (`engine.kv.decode_transient`)."""
    if geometry.gather or (window is not None and not _window_kernel_enabled):
        return False
    # the kernel's own rule (`_takes_kernel`); KV heads stand in for query heads: GQA groups
    return _takes_kernel(geometry.num_kv_heads, geometry.head_dim, geometry.num_kv_heads, geometry.quant)


def _takes_kernel(q_heads: int, head_dim: int, kv_heads: int, quant: KVQuant | None = None) -> bool:
    """The CUDA kernel reads rows of the model's dtype, or quantized rows whose groups hold
    whole lanes' values (each lane decodes head_dim / 32 of them)."""
    if quant is not None and not kernel_reads(quant):
        return False
    return kernel_active() and head_dim % 32 == 0 and q_heads % kv_heads == 0


def kernel_reads(quant: KVQuant) -> bool:
    """Whether the kernel decodes these quantized rows: a lane's values in one group."""
    return (_quant_kernel_enabled and quant.head_dim % 32 == 0
            and quant.group_size % (quant.head_dim // 32) == 0)


def decode_graph_key(g: DecodeGroup, q_heads: int, head_dim: int, kv_heads: int,
                     block_size: int, quant: KVQuant | None = None) -> tuple[int, ...]:
    """What a group's attention graph depends on besides its arrays' shapes: two steps
    with equal keys (and equal shapes) build the same graph, so a traced step
    (`engine.compiled_decode`) may replay it. Each path's use of `max_length` goes through
    the same function here as in the path itself."""
    if _takes_kernel(q_heads, head_dim, kv_heads, quant):
        return (1, *partition_split(g.write.shape[0], kv_heads, decode_span(g)))
    return (0, g.plain_blocks(block_size))


def plain_decode(
    q: mx.array, keys: mx.array, values: mx.array, g: DecodeGroup, scale: float, block_size: int,
    quant: KVQuant | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """Gather this group's slots of one layer (decoding quantized rows to the queries'
    dtype), then one masked SDPA (CPU, Metal, quantized KV, the kernel's reference)."""
    read, mask = g.plain_indices(block_size, keys.shape[1], q.dtype)
    k = pool_rows(keys)[read]  # [Bg, H, L, D]
    v = pool_rows(values)[read]
    if quant is not None:
        k, v = quant.decode(k), quant.decode(v)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def ring_run_decode(q: mx.array, keys: mx.array, values: mx.array, g: DecodeGroup, scale: float,
                    block_size: int, quant: KVQuant | None = None, sinks: mx.array | None = None) -> mx.array:
    """A lone row of a window layer whose ring is one run of blocks: SDPA over a view of
    the ring's slots (no gather) under the band mask of the plain path, cut to the view."""
    length = min(g.plain_blocks(block_size) * block_size, g.run_slots)
    assert g.run_start is not None
    _, mask = g.plain_indices(block_size, keys.shape[1], q.dtype)  # its gather indices never run
    k, v = run_view(keys, values, g.run_start, length, quant)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask[..., :length], sinks=sinks)


def run_decode(q: mx.array, keys: mx.array, values: mx.array, start: int, length: int,
               scale: float, quant: KVQuant | None = None, sinks: mx.array | None = None) -> mx.array:
    """One row whose K/V sit in consecutive slots: SDPA over a strided view of the pool,
    no gather and no mask, so MLX takes its fused decode kernel (on CUDA, `sdpa_vector`,
    which reads any strides; the bare model's step uses it too). The view's length is the
    row's, so each step is a new shape: such a step is never traced (engine.compiled_decode).
    Quantized rows are decoded from the view: one contiguous transient of the row's K/V."""
    k, v = run_view(keys, values, start, length, quant)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, sinks=sinks)


def install_attention_hook(model: Any) -> int:
    """Rebind `scaled_dot_product_attention` in the modules defining the model's layers.

    Returns how many modules were rebound; zero means the model's attention does not go
    through mlx-lm's shared function, and the paged store cannot serve it.
    """
    modules = _attention_modules(model)
    for module in modules:
        module.scaled_dot_product_attention = paged_scaled_dot_product_attention
    return len(modules)


def attends_through_shared_sdpa(model: Any) -> bool:
    """Whether the model's attention calls mlx-lm's shared `scaled_dot_product_attention`,
    which the paged store answers from the pool; a model that computes its scores itself
    (Gemma 2's soft-capping) attends each decode row's gathered K/V instead."""
    return bool(_attention_modules(model))


def _attention_modules(model: Any) -> list[ModuleType]:
    """The modules defining the model's layers that name mlx-lm's attention function (or
    this module's, rebound already)."""
    original = _original()
    found = []
    for module in layer_modules(model):
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is original or fn is paged_scaled_dot_product_attention:
            found.append(module)
    return found


def layer_modules(model: Any) -> list[ModuleType]:
    """The Python modules that define the model's layers (mlx-lm's model files), where the
    attention function a layer calls is looked up by name."""
    names = sorted({type(m).__module__ for m in _modules(model)})
    return [module for name in names if (module := sys.modules.get(name)) is not None]


def _original() -> Callable[..., mx.array]:
    """mlx-lm's attention function. Imported on first use, once a model is loaded: mlx-lm
    imports transformers, a second or more that a server should not pay before it starts."""
    global _ORIGINAL
    if _ORIGINAL is None:
        import mlx_lm.models.base as mlx_base

        _ORIGINAL = mlx_base.scaled_dot_product_attention
    return _ORIGINAL


def _modules(model: Any) -> list[Any]:
    inner = getattr(model, "_model", None)  # wrappers (tests' fault injectors) forward
    target = inner if inner is not None and hasattr(inner, "modules") else model
    return list(target.modules()) if hasattr(target, "modules") else []
