"""The paged decode kernel laid out as MLX's `sdpa_vector` (CUDA only; a `bench.kernel_sweep`
variant until it is measured; `bench.kernel_compile` compiles it without a GPU).

Why. At batch 1 the engine's kernel and merge take 47 us per layer under ncu, and MLX's
two-pass `sdpa_vector` 19 us over the same keys (docs/throughput.md, session 11), and
neither finer partitions nor a faster merge moved the engine's. The layouts differ:

- the engine: one block per (row, KV head, partition of consecutive tokens), 4 warps, each
  warp scoring U tokens at a time for all REP query heads of its KV head (20 shuffles per
  token at GQA 4), 136 blocks at batch 1 and 1k tokens;
- `sdpa_vector`: one block per (row, query head, one of 32 slices), 8 warps, each warp taking
  one token at a time, the slices interleaved (token i goes to slice (i / 8) % 32): 1,024
  blocks at batch 1, 5 shuffles per token, each K/V row read by REP blocks (from L2).

This is the second layout reading the pool through the block table, with the length as
data (so a traced step replays it). Slices interleave as in `sdpa_vector`; the merge does not
care which tokens a partition holds, so its outputs go to the engine's merge (or
`bench.kernel_merge`'s) unchanged: [B, Hq, S, D] partial sums, maxima, normalisers.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from engine.kv import cuda_decode

WARPS = 8
MAX_SLICES = 32  # sdpa_vector's
TARGET_BLOCKS = 1024

SOURCE = r"""
    constexpr int E = D / 32;
    constexpr int HQ = H * REP;
    const int bh = blockIdx.x;
    const int b = bh / HQ;
    const int hq = bh % HQ;
    const int h = hq / REP;
    const int s = blockIdx.y;
    const int S = gridDim.y;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int nb = table_shape[1];
    const int len = lengths[b];
    const float sc = scale[0];

    float qv[E];
    float acc[E];
    const T* qp = q + ((size_t)(b * HQ + hq)) * D + lane * E;
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        qv[e] = static_cast<float>(qp[e]) * sc;
        acc[e] = 0.f;
    }
    float m = NEG_INF;
    float l = 0.f;

    for (int j = s * WARPS + warp; j < len; j += S * WARPS) {
        const int blk = table[b * nb + j / BS];
        const size_t base = (((size_t)blk * BS + j % BS) * H + h) * D + lane * E;
        float kv[E];
        float vv[E];
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            kv[e] = static_cast<float>(k_pool[base + e]);
            vv[e] = static_cast<float>(v_pool[base + e]);
        }
        float x = 0.f;
        #pragma unroll
        for (int e = 0; e < E; ++e) x += qv[e] * kv[e];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
        const float nm = fmaxf(m, x);
        const float corr = __expf(m - nm);
        const float pr = __expf(x - nm);
        l = l * corr + pr;
        #pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = acc[e] * corr + pr * vv[e];
        m = nm;
    }

    __shared__ float sm_m[WARPS];
    __shared__ float sm_l[WARPS];
    __shared__ float sm_acc[WARPS][D];
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
    #pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][lane * E + e] = acc[e];
    __syncthreads();

    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float mm = NEG_INF;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_m[w]);
        float ll = 0.f;
        float a = 0.f;
        if (mm > NEG_INF) {
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float wt = __expf(sm_m[w] - mm);
                ll += sm_l[w] * wt;
                a += sm_acc[w][d] * wt;
            }
        }
        const size_t row = (size_t)(b * HQ + hq) * S + s;
        out[row * D + d] = a;
        if (d == 0) {
            out_m[row] = mm;
            out_l[row] = ll;
        }
    }
"""


def slices(batch: int, q_heads: int) -> int:
    """Slices per (row, query head): `sdpa_vector`'s 32 at batch 1, fewer as the grid fills."""
    return max(1, min(MAX_SLICES, TARGET_BLOCKS // (batch * q_heads)))


@functools.lru_cache(maxsize=64)
def launch(b: int, hq: int, h: int, d: int, part: int, parts: int, dtype: mx.Dtype, block_size: int,
           unroll: int) -> cuda_decode._Launch:
    """`cuda_decode._launch`'s signature, so `paged_decode` launches this layout unchanged.
    The partition (`part`, `parts`) is ignored: slices interleave over the whole row."""
    if d % 32 or hq % h:
        raise ValueError(f"paged kernel needs head_dim % 32 == 0 and GQA groups (got {d}, {hq}/{h})")
    n = slices(b, hq)
    return cuda_decode._Launch(
        template=[("T", dtype), ("D", d), ("H", h), ("REP", hq // h), ("BS", block_size),
                  ("WARPS", WARPS), ("U", 1)],
        grid=(32 * WARPS * b * hq, n, 1),
        output_shapes=[(b, hq, n, d), (b, hq, n), (b, hq, n)],
        part=mx.array([part], dtype=mx.int32),
    )
