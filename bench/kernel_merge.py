"""A merge of the paged kernel's partitions spread over a block's threads (CUDA only; a
`bench.kernel_sweep` variant until it is measured; `bench.kernel_compile` compiles it
without a GPU).

The engine's merge (`engine.kv.cuda_decode._MERGE_SOURCE`) gives each output element one
thread that loops over every partition, twice (the maximum, then the weighted sums). At
batch 1 that is 32 blocks, one per query head, so more partitions make it slower: in
session 10, 69 partitions of 16 tokens made the whole batch-1 step slower (6.7-7.3 ms
against 6.1-6.2), although the attention kernel itself is latency-bound there with one
block per SM (ncu: 37 us per layer at 2 % of DRAM bandwidth; docs/throughput.md).

Here LANES threads share each output element: lane i folds partitions i, i + LANES, ...
into a running (max, sum, weighted V) in one pass, as the attention kernel's warps do, and
the lanes are merged in shared memory. The outputs and their layout are the engine
merge's, so `paged_decode` is unchanged around it.

Measured on the H200 in session 11: correct (max error one bf16 step, as the engine's), 4.8
against 7.1 us per layer at 17 partitions under ncu, but no shorter batch-1 step, so it stays
here (docs/throughput.md, "Measured on the H200 (session 11)").
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from engine.kv import cuda_decode

MAX_THREADS = 1024  # a CUDA block's limit
MAX_LANES = 8

_SOURCE = r"""
    const int row = blockIdx.x;
    const int d = threadIdx.x;
    const int lane = threadIdx.y;
    const int P = m_shape[2];  // m is [B, Hq, P]
    const float* mr = m + (size_t)row * P;
    const float* lr = l + (size_t)row * P;
    const float* ar = part_out + (size_t)row * P * D + d;

    float mt = NEG_INF;
    float lt = 0.f;
    float at = 0.f;
    for (int p = lane; p < P; p += LANES) {
        const float mp = mr[p];
        if (mp == NEG_INF) continue;  // a partition past the row's length
        const float nm = fmaxf(mt, mp);
        const float c_old = __expf(mt - nm);
        const float c_new = __expf(mp - nm);
        lt = lt * c_old + lr[p] * c_new;
        at = at * c_old + ar[(size_t)p * D] * c_new;
        mt = nm;
    }

    __shared__ float sm_m[LANES];
    __shared__ float sm_l[LANES];
    __shared__ float sm_a[LANES][D];
    if (d == 0) {
        sm_m[lane] = mt;
        sm_l[lane] = lt;
    }
    sm_a[lane][d] = at;
    __syncthreads();

    if (lane == 0) {
        float mm = NEG_INF;
        #pragma unroll
        for (int i = 0; i < LANES; ++i) mm = fmaxf(mm, sm_m[i]);
        float ll = 0.f;
        float a = 0.f;
        if (mm > NEG_INF) {
            #pragma unroll
            for (int i = 0; i < LANES; ++i) {
                const float w = __expf(sm_m[i] - mm);
                ll += sm_l[i] * w;
                a += sm_a[i][d] * w;
            }
        }
        y[(size_t)row * D + d] = static_cast<T>(ll > 0.f ? a / ll : 0.f);
    }
"""

_kernel: list[Any] = []


def _get_kernel() -> Any:
    if not _kernel:
        _kernel.append(cuda_decode.build_merge_kernel("headroom_paged_decode_merge_lanes", _SOURCE))
    return _kernel[0]


def merge_lanes(parts: int, head_dim: int) -> int:
    """Threads per output element: enough to share the partitions, within a block's limit
    (1 when there is one partition: the merge is then only the division)."""
    lanes = 1
    while lanes < MAX_LANES and lanes < parts and 2 * lanes * head_dim <= MAX_THREADS:
        lanes *= 2
    return lanes


@functools.lru_cache(maxsize=64)
def merge_launch(b: int, hq: int, parts: int, d: int, dtype: mx.Dtype) -> dict[str, Any]:
    """The launch for [B, Hq, P, D] partial sums: one block per (row, query head), D x LANES
    threads."""
    lanes = merge_lanes(parts, d)
    return {"template": [("T", dtype), ("D", d), ("LANES", lanes)], "grid": (d * b * hq, lanes, 1),
            "threadgroup": (d, lanes, 1), "output_shapes": [(b, hq, 1, d)], "output_dtypes": [dtype]}


def merge_partitions(out: mx.array, m: mx.array, l_sum: mx.array, dtype: mx.Dtype) -> mx.array:
    """`engine.kv.cuda_decode.merge_partitions`'s contract, in one launch of the lanes' merge."""
    b, hq, parts, d = out.shape
    (y,) = _get_kernel()(inputs=[out, m, l_sum], **merge_launch(b, hq, parts, d, dtype))
    return y
