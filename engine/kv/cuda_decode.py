"""A paged decode-attention kernel for CUDA (`mx.fast.cuda_kernel`), split over the context.

It reads K/V straight from a segment's pool through each row's block table and its own
length: no gather, no mask, no padding to the longest row. Its plain-MLX twin is
`engine.kv.attention.plain_decode`, the reference it is tested against on the H200.

Work split: one thread block per (row, KV head, partition of PART tokens); its 4 warps
take tokens in turn, one token per warp step (each lane holds D/32 elements, so K and V
rows are read coalesced), and serve all the query heads of that KV head (GQA) at once.
Each warp loads UNROLL consecutive tokens (one block) before it scores them, so
several loads are in flight per warp. Each block keeps a running max / sum / weighted V
(online softmax), the warps are merged in shared memory, and a second small kernel merges
the partitions (log-sum-exp weights) and writes the model's dtype. Two launches per layer,
not ten: on CUDA each MLX op costs host time to encode, and a decode step of an 8B model
is short enough for that to show (`docs/throughput.md`).
Tokens per partition come from a small fixed set and reach the kernel as an input, not a
template constant: lengths that grow and batches that change never recompile it (each
NVRTC compile costs a second or more in the middle of serving).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.kv.device_vectors import device_vector
from engine.kv.quant import KVQuant

WARPS = 4
UNROLL = 4  # tokens per warp step (1 = one token at a time, the first version)
PARTITIONS = (64, 256, 1024, 4096, 16384, 65536, 262144)
TARGET_BLOCKS = 1056  # ~8 blocks per SM on an H200 (132 SMs)

_SOURCE = r"""
    constexpr int E = D / 32;
    const int bh = blockIdx.x;
    const int b = bh / H;
    const int h = bh % H;
    const int p = blockIdx.y;
    const int P = gridDim.y;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int nb = table_shape[1];
    const int len = lengths[b];
    const int PART = part[0];
    const int start = p * PART;
    const int end = min(len, start + PART);
    const float sc = scale[0];

    float qv[REP][E];
    float m[REP];
    float l[REP];
    float acc[REP][E];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        const T* qp = q + ((size_t)(b * H * REP + h * REP + r)) * D + lane * E;
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            qv[r][e] = static_cast<float>(qp[e]) * sc;
            acc[r][e] = 0.f;
        }
        m[r] = NEG_INF;
        l[r] = 0.f;
    }

    for (int j0 = start + warp * U; j0 < end; j0 += WARPS * U) {
        // U consecutive tokens per warp step: U % BS == 0 and j0 % U == 0 put them in one
        // block, and their loads are all in flight before the first score is needed.
        const int blk = table[b * nb + j0 / BS];
        const size_t base0 = (((size_t)blk * BS + j0 % BS) * H + h) * D + lane * E;
        float kv[U][E];
        float vv[U][E];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const bool live = j0 + u < end;
            const size_t base = base0 + (size_t)u * H * D;
            #pragma unroll
            for (int e = 0; e < E; ++e) {
                kv[u][e] = live ? static_cast<float>(k_pool[base + e]) : 0.f;
                vv[u][e] = live ? static_cast<float>(v_pool[base + e]) : 0.f;
            }
        }
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            float s[U];
            float nm = m[r];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                float x = 0.f;
                #pragma unroll
                for (int e = 0; e < E; ++e) x += qv[r][e] * kv[u][e];
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
                s[u] = j0 + u < end ? x : NEG_INF;
                nm = fmaxf(nm, s[u]);
            }
            const float corr = __expf(m[r] - nm);
            l[r] *= corr;
            #pragma unroll
            for (int e = 0; e < E; ++e) acc[r][e] *= corr;
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const float pr = __expf(s[u] - nm);
                l[r] += pr;
                #pragma unroll
                for (int e = 0; e < E; ++e) acc[r][e] += pr * vv[u][e];
            }
            m[r] = nm;
        }
    }

    __shared__ float sm_m[WARPS][REP];
    __shared__ float sm_l[WARPS][REP];
    __shared__ float sm_acc[WARPS][REP][D];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        if (lane == 0) {
            sm_m[warp][r] = m[r];
            sm_l[warp][r] = l[r];
        }
        #pragma unroll
        for (int e = 0; e < E; ++e) sm_acc[warp][r][lane * E + e] = acc[r][e];
    }
    __syncthreads();

    for (int idx = threadIdx.x; idx < REP * D; idx += blockDim.x) {
        const int r = idx / D;
        const int d = idx % D;
        float mm = NEG_INF;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_m[w][r]);
        float ll = 0.f;
        float a = 0.f;
        if (mm > NEG_INF) {
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float wt = __expf(sm_m[w][r] - mm);
                ll += sm_l[w][r] * wt;
                a += sm_acc[w][r][d] * wt;
            }
        }
        const size_t row = (size_t)(b * H * REP + h * REP + r) * P + p;
        out[row * D + d] = a;
        if (d == 0) {
            out_m[row] = mm;
            out_l[row] = ll;
        }
    }
"""

_MERGE_SOURCE = r"""
    const int row = blockIdx.x;
    const int d = threadIdx.x;
    const int P = m_shape[2];  // m is [B, Hq, P]
    const float* mr = m + (size_t)row * P;
    const float* lr = l + (size_t)row * P;
    float mm = NEG_INF;
    for (int p = 0; p < P; ++p) mm = fmaxf(mm, mr[p]);
    float ll = 0.f;
    float a = 0.f;
    if (mm > NEG_INF) {
        for (int p = 0; p < P; ++p) {
            const float w = __expf(mr[p] - mm);
            ll += lr[p] * w;
            a += part_out[((size_t)row * P + p) * D + d] * w;
        }
    }
    y[(size_t)row * D + d] = static_cast<T>(ll > 0.f ? a / ll : 0.f);
"""

# Window layers (`memory.paged`): a row attends positions [first, length) of a ring of
# `ring` blocks, position j in block table[(j / BS) % ring]. Partitions start at `first`
# rounded down to a warp step; positions before it score -inf, as those past the end do.
_RING_SOURCE = (
    _SOURCE
    .replace("const int len = lengths[b];",
             "const int len = lengths[b];\n    const int lo = first[b];\n    const int rb = ring[b];")
    .replace("const int start = p * PART;", "const int start = (lo / U) * U + p * PART;")
    .replace("const int blk = table[b * nb + j0 / BS];", "const int blk = table[b * nb + (j0 / BS) % rb];")
    .replace("const bool live = j0 + u < end;", "const bool live = j0 + u < end && j0 + u >= lo;")
    .replace("s[u] = j0 + u < end ? x : NEG_INF;", "s[u] = (j0 + u < end && j0 + u >= lo) ? x : NEG_INF;")
)

# Quantized KV (`engine.kv.quant`): a slot holds, per head, RW uint32 words, PW of packed
# values then NG scales and NG biases of T. Each lane decodes its E values of the row where
# it reads them (one word of 8-bit values, half a word of 4-bit ones, for head_dim 128), so
# a decode step gathers nothing and dequantizes nothing beside the kernel.
_QUANT_LOADS = r"""            #pragma unroll
            for (int e = 0; e < E; ++e) {
                kv[u][e] = 0.f;
                vv[u][e] = 0.f;
            }
            if (live) {
                const unsigned* kr = k_pool + base;
                const unsigned* vr = v_pool + base;
                const T* ka = reinterpret_cast<const T*>(kr + PW);
                const T* va = reinterpret_cast<const T*>(vr + PW);
                const int grp = (lane * E) / GS;
                const float ks = static_cast<float>(ka[grp]), kb = static_cast<float>(ka[NG + grp]);
                const float vs = static_cast<float>(va[grp]), vb = static_cast<float>(va[NG + grp]);
                #pragma unroll
                for (int e = 0; e < E; ++e) {
                    const int i = lane * E + e;
                    const int sh = (i % (32 / BITS)) * BITS;
                    const unsigned mask = (1u << BITS) - 1u;
                    kv[u][e] = ks * static_cast<float>((kr[i / (32 / BITS)] >> sh) & mask) + kb;
                    vv[u][e] = vs * static_cast<float>((vr[i / (32 / BITS)] >> sh) & mask) + vb;
                }
            }
"""
_PLAIN_LOADS = r"""            #pragma unroll
            for (int e = 0; e < E; ++e) {
                kv[u][e] = live ? static_cast<float>(k_pool[base + e]) : 0.f;
                vv[u][e] = live ? static_cast<float>(v_pool[base + e]) : 0.f;
            }
"""


def _quantized(source: str) -> str:
    """`source` reading quantized rows of RW words (one of the variants above)."""
    assert source.count(_PLAIN_LOADS) == 1
    return (source
            .replace("* H + h) * D + lane * E;", "* H + h) * RW;")
            .replace("const size_t base = base0 + (size_t)u * H * D;",
                     "const size_t base = base0 + (size_t)u * H * RW;")
            .replace(_PLAIN_LOADS, _QUANT_LOADS))


_QUANT_SOURCE = _quantized(_SOURCE)
_QUANT_RING_SOURCE = _quantized(_RING_SOURCE)

# gpt-oss's sinks: one logit per query head that joins each row's softmax with no value.
_SINKS_MERGE_SOURCE = (
    _MERGE_SOURCE
    .replace("    float ll = 0.f;\n    float a = 0.f;\n    if (mm > NEG_INF) {",
             "    const float sk = sinks[row % HQ];\n    const float top = fmaxf(mm, sk);\n"
             "    float ll = __expf(sk - top);\n    float a = 0.f;\n    if (mm > NEG_INF) {")
    .replace("const float w = __expf(mr[p] - mm);", "const float w = __expf(mr[p] - top);")
)

_HEADER = "#define NEG_INF (-__int_as_float(0x7f800000))\n"

_built: dict[str, Any] = {}  # kernels by name, compiled on first use
_scales: dict[float, mx.array] = {}
_F32X3 = [mx.float32, mx.float32, mx.float32]


def build_kernel(name: str = "headroom_paged_decode", source: str = _SOURCE,
                 extra_inputs: tuple[str, ...] = ()) -> Any:
    """The paged kernel from `source`, with the inputs and outputs `paged_decode` passes
    (a variant of the source needs its own name: MLX caches a compiled kernel by name)."""
    return mx.fast.cuda_kernel(
        name=name,
        input_names=["q", "k_pool", "v_pool", "table", "lengths", "scale", "part", *extra_inputs],
        output_names=["out", "out_m", "out_l"],
        source=source,
        header=_HEADER,
    )


def build_merge_kernel(name: str = "headroom_paged_decode_merge", source: str = _MERGE_SOURCE,
                       extra_inputs: tuple[str, ...] = ()) -> Any:
    """A partitions' merge from `source`, with the inputs and output `merge_partitions`
    passes (a variant needs its own name, as for `build_kernel`)."""
    return mx.fast.cuda_kernel(
        name=name,
        input_names=["part_out", "m", "l", *extra_inputs],
        output_names=["y"],
        source=source,
        header=_HEADER,
    )


def _built_once(name: str, build: Any) -> Any:
    if name not in _built:
        _built[name] = build()
    return _built[name]


def _get_kernel() -> Any:
    return _built_once("attend", build_kernel)


def _get_merge_kernel() -> Any:
    return _built_once("merge", build_merge_kernel)


def _get_ring_kernel() -> Any:
    return _built_once("ring", lambda: build_kernel(
        "headroom_paged_decode_ring", _RING_SOURCE, ("first", "ring")))


def _get_quant_kernel(ring: bool) -> Any:
    if ring:
        return _built_once("quant_ring", lambda: build_kernel(
            "headroom_paged_decode_quant_ring", _QUANT_RING_SOURCE, ("first", "ring")))
    return _built_once("quant", lambda: build_kernel("headroom_paged_decode_quant", _QUANT_SOURCE))


def _get_sinks_merge_kernel() -> Any:
    return _built_once("sinks", lambda: build_merge_kernel(
        "headroom_paged_decode_merge_sinks", _SINKS_MERGE_SOURCE, ("sinks",)))


def partition_tokens(batch: int, kv_heads: int, max_length: int) -> int:
    """The smallest partition that keeps the grid near TARGET_BLOCKS blocks."""
    for part in PARTITIONS:
        if part >= max_length or batch * kv_heads * -(-max_length // part) <= TARGET_BLOCKS:
            return part
    return PARTITIONS[-1]


def partition_split(batch: int, kv_heads: int, max_length: int) -> tuple[int, int]:
    """(tokens per partition, partitions) for a step: what the launch, and so the step's
    graph, depends on of the context length (`engine.kv.attention.decode_graph_key`)."""
    part = partition_tokens(batch, kv_heads, max_length)
    return part, -(-max_length // part)


def window_span(max_length: int, window: int | None) -> int:
    """Positions the kernel's partitions cover: a window row's from its first attended
    position rounded down to a warp step, so at most window + UNROLL - 1."""
    return max_length if window is None else min(max_length, window + UNROLL)


def decode_span(g: Any) -> int:
    """A decode group's span (`engine.kv.cache.DecodeGroup`), as `paged_decode` computes it."""
    return window_span(g.max_length, g.window if g.ring is not None else None)


@dataclass(frozen=True)
class _Launch:
    """One step's launch settings: the same for every layer, so built once per step."""

    template: list[tuple[str, Any]]
    grid: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    part: mx.array


@functools.lru_cache(maxsize=64)
def _launch(b: int, hq: int, h: int, d: int, part: int, parts: int, dtype: mx.Dtype, block_size: int,
            unroll: int, quant: KVQuant | None = None) -> _Launch:
    """Keyed by the partition, not the length: a growing context reuses it until the
    partition count changes."""
    if d % 32 or hq % h:
        raise ValueError(f"paged kernel needs head_dim % 32 == 0 and GQA groups (got {d}, {hq}/{h})")
    u = unroll if block_size % unroll == 0 else 1
    rows: list[tuple[str, Any]] = []
    if quant is not None:
        rows = [("BITS", quant.bits), ("GS", quant.group_size), ("PW", quant.packed_words),
                ("NG", quant.groups), ("RW", quant.row_words)]
    return _Launch(
        template=[("T", dtype), ("D", d), ("H", h), ("REP", hq // h), ("BS", block_size),
                  ("WARPS", WARPS), ("U", u), *rows],
        grid=(32 * WARPS * b * h, parts, 1),
        output_shapes=[(b, hq, parts, d), (b, hq, parts), (b, hq, parts)],
        part=device_vector([part]),
    )


def paged_decode(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    table: mx.array,
    lengths: mx.array,
    max_length: int,
    scale: float,
    block_size: int,
    *,
    window: int | None = None,
    ring: mx.array | None = None,
    sinks: mx.array | None = None,
    quant: KVQuant | None = None,
) -> mx.array:
    """q [B, Hq, 1, D]; pools [slots, H, D]; table [B, NB] int32; lengths [B] int32. A
    window layer's rows attend their last `window` positions through rings of `ring` [B]
    blocks; `sinks` [Hq] joins each query head's softmax (gpt-oss); with `quant`, the pools
    hold quantized rows [slots, H, row_words] (`engine.kv.quant`), decoded as they are read."""
    b, hq, _, d = q.shape
    h = k_pool.shape[1]
    first = None
    if ring is not None:
        assert window is not None
        first = mx.maximum(lengths - window, 0)
    span = window_span(max_length, window if ring is not None else None)
    launch = _launch(b, hq, h, d, *partition_split(b, h, span), q.dtype, block_size, UNROLL, quant)
    sc = _scales.get(scale)
    if sc is None:
        sc = _scales[scale] = device_vector([scale], mx.float32)
    inputs = [q, k_pool, v_pool, table, lengths, sc, launch.part]
    if quant is not None:
        kernel = _get_quant_kernel(ring is not None)
    else:
        kernel = _get_kernel() if ring is None else _get_ring_kernel()
    if ring is not None:
        inputs += [first, ring]
    out, m, l_sum = kernel(
        inputs=inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=launch.output_shapes,
        output_dtypes=_F32X3,
    )
    return merge_partitions(out, m, l_sum, q.dtype, sinks)


def merge_partitions(out: mx.array, m: mx.array, l_sum: mx.array, dtype: mx.Dtype,
                     sinks: mx.array | None = None) -> mx.array:
    """[B, Hq, P, D] partial sums with their maxima and normalisers -> [B, Hq, 1, D] in
    `dtype`, in one launch; with `sinks` [Hq], each head's sink logit in the softmax."""
    b, hq, _, d = out.shape
    template, grid, shapes, dtypes = _merge_launch(b, hq, d, dtype)
    if sinks is None:
        (y,) = _get_merge_kernel()(
            inputs=[out, m, l_sum], template=template, grid=grid, threadgroup=(d, 1, 1),
            output_shapes=shapes, output_dtypes=dtypes,
        )
        return y
    (y,) = _get_sinks_merge_kernel()(
        inputs=[out, m, l_sum, sinks.astype(mx.float32)], template=[*template, ("HQ", hq)], grid=grid,
        threadgroup=(d, 1, 1), output_shapes=shapes, output_dtypes=dtypes,
    )
    return y


@functools.lru_cache(maxsize=64)
def _merge_launch(b: int, hq: int, d: int, dtype: mx.Dtype) -> tuple[Any, ...]:
    return [("T", dtype), ("D", d)], (d * b * hq, 1, 1), [(b, hq, 1, d)], [dtype]


def merge_partitions_reference(out: mx.array, m: mx.array, l_sum: mx.array, dtype: mx.Dtype) -> mx.array:
    """The same merge in plain MLX ops (about ten launches): the kernel's reference."""
    top = mx.max(m, axis=-1, keepdims=True)
    w = mx.exp(m - top)
    res = (out * w[..., None]).sum(axis=2) / (l_sum * w).sum(axis=-1, keepdims=True)
    return res.astype(dtype)[:, :, None, :]
