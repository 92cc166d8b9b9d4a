"""A quantized matmul for a few rows on CUDA that reads the weight once, on tensor cores.

A decode step multiplies B rows (one per sequence, B up to a batch of 64) by every
quantized weight. MLX 0.32's CUDA product for such shapes moves 530–630 GB/s of weights at
32–64 rows, where the bf16 product of the same shape moves 3–4 TB/s, so a 4-bit model
decodes a batch slower than its bf16 original though it reads 3.6× fewer bytes (see
`engine.quantized`). This kernel is the small-M case done the way vLLM's Marlin-style and
TensorRT-LLM's weight-only kernels do it: the weight tile is dequantized in registers and
multiplied on the tensor cores with the rows as the narrow operand ("swap AB": the weight's
output channels are the MMA's 16 rows, the input rows its 8 columns), so each weight byte
is loaded once and reused for every input row.

Layout: one warp owns 16 output channels; a thread block holds `NPB` warps (16·NPB
channels); blocks along grid.y split K when there are too few channel tiles to fill the
card, and a second launch sums their fp32 partials. K goes by chunks of 64: lane (g, t)
(g = lane / 4, t = lane % 4) dequantizes values [16t, 16t+16) of the chunk for channels g
and g + 8 and loads the same 16 values of each input row g of a tile of 8. A dot product
does not care which k meets which MMA slot as long as both operands agree, so a thread's
16 consecutive k feed its own slots (2t, 2t+1, 2t+8, 2t+9) of four MMA steps: the input
rows are loaded as they lie, 16 bytes at a time, with no shuffle.

Dequantizing: MLX's affine format keeps value i of a uint32 at bits [bits·i, bits·(i+1)),
and `w = scale · q + bias` per group. 4-bit: two neighbouring nibbles are placed in the
low bits of a bf16 pair whose exponent reads 128 (0x4300), minus 128 gives q exactly, and
one bf16x2 FMA gives `scale · q + bias` rounded once. 8-bit goes through fp32 (a bf16
mantissa cannot hold 8 bits above 128).

The host side (`small_m_qmm`) takes x as (M, K) bf16 with M ≤ MAX_ROWS, affine 4- or
8-bit weights with group size 32, 64 or 128, K a multiple of 64 and N of 16; anything else
is the caller's to send to `mx.quantized_matmul` (`supports`). Compiles: one per (bits,
group size, row tile, split) met, each on first use (NVRTC, about a second).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

MAX_ROWS = 64
ROW_TILES = (1, 2, 4, 8)  # tiles of 8 input rows a kernel is built for
NPB = 4  # warps (16 channels each) per thread block
TARGET_BLOCKS = 264  # two blocks per SM on a 132-SM card
MIN_SPLIT_K = 512  # a split's K: below this the partials cost more than they save
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)

_HEADER = r"""
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned as_u32(__nv_bfloat162 v) { return *reinterpret_cast<unsigned*>(&v); }

// byte s of w as two nibbles in a bf16 pair, dequantized: (scale*q + bias) for both
__device__ __forceinline__ unsigned dq4(unsigned w, unsigned hi4, int s, __nv_bfloat162 sc,
                                        __nv_bfloat162 bi) {
    const unsigned sel = s | (s << 4) | ((4 + s) << 8) | ((4 + s) << 12);
    unsigned p = (__byte_perm(w, hi4, sel) & 0x000F000Fu) | 0x43004300u;
    __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&p);
    v = __hsub2(v, __floats2bfloat162_rn(128.f, 128.f));
    return as_u32(__hfma2(v, sc, bi));
}

// bytes j and j+1 of w (j even) as 8-bit values, dequantized into a bf16 pair
__device__ __forceinline__ unsigned dq8(unsigned w, int j, float sc, float bi) {
    const float lo = __int_as_float(__byte_perm(w, 0x4B000000u, 0x7540 | j)) - 8388608.f;
    const float hi = __int_as_float(__byte_perm(w, 0x4B000000u, 0x7540 | (j + 1))) - 8388608.f;
    return as_u32(__floats2bfloat162_rn(fmaf(sc, lo, bi), fmaf(sc, hi, bi)));
}
"""

_SOURCE = r"""
    constexpr int PER_WORD = 32 / BITS;   // values in a uint32
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int KW = w_shape[1];
    const int NG = scales_shape[1];
    const int n0 = (blockIdx.x * NPB + (threadIdx.x >> 5)) * 16;
    if (n0 >= N) return;
    const int ks = K / gridDim.y;
    const int kbeg = blockIdx.y * ks;
    const unsigned* wr0 = w + (size_t)(n0 + g) * KW;
    const unsigned* wr1 = w + (size_t)(n0 + g + 8) * KW;
    const T* sr0 = scales + (size_t)(n0 + g) * NG;
    const T* sr1 = scales + (size_t)(n0 + g + 8) * NG;
    const T* br0 = biases + (size_t)(n0 + g) * NG;
    const T* br1 = biases + (size_t)(n0 + g + 8) * NG;

    float acc[MT][4];
    #pragma unroll
    for (int j = 0; j < MT; ++j) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
    }

    for (int k0 = kbeg; k0 < kbeg + ks; k0 += 64) {
        const int kk = k0 + 16 * t;
        unsigned q0[4], q1[4];  // WORDS of them used; one vector load per channel
        if (BITS == 4) {
            const uint2 v0 = *reinterpret_cast<const uint2*>(wr0 + kk / PER_WORD);
            const uint2 v1 = *reinterpret_cast<const uint2*>(wr1 + kk / PER_WORD);
            q0[0] = v0.x; q0[1] = v0.y; q1[0] = v1.x; q1[1] = v1.y;
        } else {
            const uint4 v0 = *reinterpret_cast<const uint4*>(wr0 + kk / PER_WORD);
            const uint4 v1 = *reinterpret_cast<const uint4*>(wr1 + kk / PER_WORD);
            q0[0] = v0.x; q0[1] = v0.y; q0[2] = v0.z; q0[3] = v0.w;
            q1[0] = v1.x; q1[1] = v1.y; q1[2] = v1.z; q1[3] = v1.w;
        }
        const int gi = kk / GS;
        unsigned a[4][4];  // per MMA step: channel g k-lo, g+8 k-lo, g k-hi, g+8 k-hi
        if (BITS == 4) {
            const __nv_bfloat162 s0 = __bfloat162bfloat162(sr0[gi]), b0 = __bfloat162bfloat162(br0[gi]);
            const __nv_bfloat162 s1 = __bfloat162bfloat162(sr1[gi]), b1 = __bfloat162bfloat162(br1[gi]);
            const unsigned h00 = q0[0] >> 4, h01 = q0[1] >> 4, h10 = q1[0] >> 4, h11 = q1[1] >> 4;
            #pragma unroll
            for (int s = 0; s < 4; ++s) {
                a[s][0] = dq4(q0[0], h00, s, s0, b0);
                a[s][1] = dq4(q1[0], h10, s, s1, b1);
                a[s][2] = dq4(q0[1], h01, s, s0, b0);
                a[s][3] = dq4(q1[1], h11, s, s1, b1);
            }
        } else {
            const float s0 = static_cast<float>(sr0[gi]), b0 = static_cast<float>(br0[gi]);
            const float s1 = static_cast<float>(sr1[gi]), b1 = static_cast<float>(br1[gi]);
            #pragma unroll
            for (int s = 0; s < 4; ++s) {
                // k-lo pair: bytes 2s, 2s+1 of the 16; k-hi: bytes 8+2s, 9+2s
                a[s][0] = dq8(q0[s >> 1], (2 * s) & 3, s0, b0);
                a[s][1] = dq8(q1[s >> 1], (2 * s) & 3, s1, b1);
                a[s][2] = dq8(q0[2 + (s >> 1)], (2 * s) & 3, s0, b0);
                a[s][3] = dq8(q1[2 + (s >> 1)], (2 * s) & 3, s1, b1);
            }
        }
        #pragma unroll
        for (int j = 0; j < MT; ++j) {
            const int row = j * 8 + g;
            uint4 xl = make_uint4(0, 0, 0, 0), xh = make_uint4(0, 0, 0, 0);
            if (row < M) {
                const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)row * K + kk);
                xl = xp[0];
                xh = xp[1];
            }
            mma_bf16(acc[j], a[0][0], a[0][1], a[0][2], a[0][3], xl.x, xh.x);
            mma_bf16(acc[j], a[1][0], a[1][1], a[1][2], a[1][3], xl.y, xh.y);
            mma_bf16(acc[j], a[2][0], a[2][1], a[2][2], a[2][3], xl.z, xh.z);
            mma_bf16(acc[j], a[3][0], a[3][1], a[3][2], a[3][3], xl.w, xh.w);
        }
    }

    #pragma unroll
    for (int j = 0; j < MT; ++j) {
        const int r0 = j * 8 + 2 * t;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = r0 + (i & 1);
            const int col = n0 + g + (i >> 1) * 8;
            if (row < M) STORE;
        }
    }
"""

_STORE_OUT = "out[(size_t)row * N + col] = static_cast<T>(acc[j][i])"
_STORE_PART = "out[((size_t)blockIdx.y * M + row) * N + col] = acc[j][i]"

_SUM_SOURCE = r"""
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    const int S = part_shape[0];
    const int MN = part_shape[1] * part_shape[2];
    if (idx >= MN) return;
    float acc = 0.f;
    for (int s = 0; s < S; ++s) acc += part[(size_t)s * MN + idx];
    out[idx] = static_cast<T>(acc);
"""

_built: dict[str, Any] = {}


def _kernel(split: bool) -> Any:
    name = "split" if split else "whole"
    if name not in _built:
        _built[name] = mx.fast.cuda_kernel(
            name=f"headroom_small_m_qmm_{name}",
            input_names=["x", "w", "scales", "biases"],
            output_names=["out"],
            source=_SOURCE.replace("STORE", _STORE_PART if split else _STORE_OUT),
            header=_HEADER,
        )
    return _built[name]


def _sum_kernel() -> Any:
    if "sum" not in _built:
        _built["sum"] = mx.fast.cuda_kernel(
            name="headroom_small_m_qmm_sum", input_names=["part"], output_names=["out"],
            source=_SUM_SOURCE,
        )
    return _built["sum"]


def supports(*, bits: int, group_size: int, mode: str, in_features: int, out_features: int,
             has_biases: bool) -> bool:
    """Whether a weight of this format and shape can take the kernel (the rows' count and
    dtype are checked per call)."""
    return (mode == "affine" and has_biases and bits in BITS and group_size in GROUP_SIZES
            and in_features % 64 == 0 and out_features % 16 == 0)


@dataclass(frozen=True)
class Launch:
    """How a product of `rows` rows runs: row tiles, K splits, grid and threadgroup."""

    row_tiles: int
    split: int
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]


@functools.lru_cache(maxsize=512)
def plan(rows: int, in_features: int, out_features: int, npb: int = NPB,
         target_blocks: int = TARGET_BLOCKS) -> Launch:
    """The row tile that covers `rows`, and the fewest K splits (a power of two, each a
    multiple of 64 and at least MIN_SPLIT_K) that bring the grid to `target_blocks`."""
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"small-M product takes 1..{MAX_ROWS} rows, not {rows}")
    tiles = next(m for m in ROW_TILES if 8 * m >= rows)
    blocks = -(-out_features // (16 * npb))
    split = 1
    while (blocks * split < target_blocks and in_features % (64 * split * 2) == 0
           and in_features // (split * 2) >= MIN_SPLIT_K):
        split *= 2
    return Launch(tiles, split, (blocks * 32 * npb, split, 1), (32 * npb, 1, 1))


def small_m_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, bits: int,
                group_size: int, npb: int = NPB, target_blocks: int = TARGET_BLOCKS) -> mx.array:
    """x (M, K) bf16 times the affine-quantized w (N, K·bits/32) transposed: (M, N) bf16."""
    rows, k = x.shape
    n = w.shape[0]
    launch = plan(rows, k, n, npb, target_blocks)
    template = [("T", x.dtype), ("BITS", bits), ("GS", group_size), ("MT", launch.row_tiles),
                ("NPB", npb)]
    split = launch.split > 1
    (out,) = _kernel(split)(
        inputs=[x, w, scales, biases], template=template, grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=[(launch.split, rows, n) if split else (rows, n)],
        output_dtypes=[mx.float32 if split else x.dtype],
    )
    if not split:
        return out
    total = rows * n
    (summed,) = _sum_kernel()(
        inputs=[out], template=[("T", x.dtype)], grid=(-(-total // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1), output_shapes=[(rows, n)], output_dtypes=[x.dtype],
    )
    return summed
