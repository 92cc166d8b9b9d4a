"""The paged decode kernel alone, across its launch settings (CUDA only).

    python -m bench.kernel_sweep --context 1100 --batch 1,32,64

For each variant (partition sizes, target grid size, tokens per warp step) it checks the
kernel against the plain-MLX path and times 32 layers' attention (kernel + merge) at each
batch, printing ms, the KV bandwidth it reached and the (tokens per partition, partitions)
chosen. Session 8 found the paged kernel at 41 % of a batch-32 step's device time, at about
1 TB/s under ncu (`bench.ncu_summary`); this asks whether its knobs alone fix that. They did
not (bench/results/h200-20261202-s8/kernel-sweep.jsonl): the current settings were the best.

The `vector_*` variants (run in sessions 8 and 10, docs/throughput.md): each lane reads its
E = D/32 elements of a K or V row as E separate 2-byte loads; these read them as one
E-element load (8 bytes for bf16 at D=128) and keep them packed in the model's dtype until
used, so a warp has fewer load instructions and half the registers per token in flight.
They need E * sizeof(T) to be a power of two (so not D=96), which is why they live here
until measured: the sweep checks each against the plain path before it times it.

The `group*` variants change the layout, as vLLM's paged kernel does: 8 lanes share a
token (each holds D/8 elements, read in 16-byte loads), so a warp scores 4 tokens at once
and each (token, query head) costs a 3-step reduction among 8 lanes, not 5 among 32: about
3 shuffles per token at GQA 4 instead of 20. The four lane groups are merged at the end
(online-softmax state, two shuffle rounds), then the warps as before; the outputs and the
merge kernel are unchanged. They need D/8 elements to fill whole 16-byte loads.

The `pmerge*` variants were session 11's hypothesis: at batch 1 the
kernel is latency-bound with one block per SM, and finer partitions lost in session 10
because the merge loops over them in one thread per output (`bench.kernel_merge` spreads
that loop over lanes). `pmerge` keeps the engine's partitions, `pmerge_fine` takes 16
tokens (552 blocks at batch 1 and 1,100 tokens), `pmerge_fine528` 32 (280 blocks, one wave);
`pmerge_vec` and `pmerge_vec_fine` are `pmerge` and `pmerge_fine` with the `vector` loads.
On the H200 all were correct and none shortened the engine's batch-1 step: the kernel's
time barely follows its grid (bench/results/h200-20261202-s11, docs/throughput.md).

`perhead` and `perhead_lanes` are session 12's hypothesis, not yet run on a GPU: MLX's
`sdpa_vector` layout over the block table (`bench.kernel_perhead`), with the engine's merge
or the lanes merge.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import mlx.core as mx

from bench import kernel_merge, kernel_perhead
from bench.kv_store import attention_only, kernel_vs_plain, ragged
from engine.kv import cuda_decode

BASE = cuda_decode.PARTITIONS
FINE = (16, 32, *BASE)
# The engine kernel's loads run from its K/V registers' declaration to its scoring loop.
_LOADS_START = "        float kv[U][E];"
_SCORING = "        #pragma unroll\n        for (int r = 0; r < REP; ++r) {\n            float s[U];"
_VECTOR_LOADS = """\
        struct alignas(sizeof(T) * E) Pack { T x[E]; };
        Pack kp[U];
        Pack vp[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const size_t base = base0 + (size_t)u * H * D;
            if (j0 + u < end) {
                kp[u] = *reinterpret_cast<const Pack*>(k_pool + base);
                vp[u] = *reinterpret_cast<const Pack*>(v_pool + base);
            } else {
                #pragma unroll
                for (int e = 0; e < E; ++e) {
                    kp[u].x[e] = static_cast<T>(0.f);
                    vp[u].x[e] = static_cast<T>(0.f);
                }
            }
        }"""


def vector_source() -> str:
    """The paged kernel with packed loads (see the module's docstring)."""
    src = cuda_decode._SOURCE
    for marker in (_LOADS_START, _SCORING):
        if marker not in src:
            raise RuntimeError(f"the kernel's source changed; update bench.kernel_sweep: {marker[:40]!r}")
    loads = src[src.index(_LOADS_START): src.index(_SCORING)]
    return _replaced(src, (
        (loads, _VECTOR_LOADS + "\n"),
        ("qv[r][e] * kv[u][e]", "qv[r][e] * static_cast<float>(kp[u].x[e])"),
        ("pr * vv[u][e]", "pr * static_cast<float>(vp[u].x[e])"),
    ))


_GROUP_LOOP = r"""
    // j0 depends on the warp only, so every lane of a warp runs each step's shuffles.
    const int g = lane / G;
    const int s = lane % G;
    for (int j0 = start + warp * TOKENS; j0 < end; j0 += WARPS * TOKENS) {
        const int j = j0 + g;
        const bool live = j < end;
        Pack kp[NV];
        Pack vp[NV];
        if (live) {
            const int blk = table[b * nb + j / BS];
            const size_t base = (((size_t)blk * BS + j % BS) * H + h) * D + s * E;
            #pragma unroll
            for (int i = 0; i < NV; ++i) {
                kp[i] = reinterpret_cast<const Pack*>(k_pool + base)[i];
                vp[i] = reinterpret_cast<const Pack*>(v_pool + base)[i];
            }
        } else {
            #pragma unroll
            for (int i = 0; i < NV; ++i) {
                #pragma unroll
                for (int v = 0; v < V; ++v) {
                    kp[i].x[v] = static_cast<T>(0.f);
                    vp[i].x[v] = static_cast<T>(0.f);
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            float x = 0.f;
            #pragma unroll
            for (int i = 0; i < NV; ++i) {
                #pragma unroll
                for (int v = 0; v < V; ++v) x += qv[r][i * V + v] * static_cast<float>(kp[i].x[v]);
            }
            #pragma unroll
            for (int o = G / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
            const float sv = live ? x : NEG_INF;
            const float nm = fmaxf(m[r], sv);
            const float corr = nm == NEG_INF ? 1.f : __expf(m[r] - nm);
            const float pr = nm == NEG_INF ? 0.f : __expf(sv - nm);
            l[r] = l[r] * corr + pr;
            #pragma unroll
            for (int i = 0; i < NV; ++i) {
                #pragma unroll
                for (int v = 0; v < V; ++v) {
                    acc[r][i * V + v] = acc[r][i * V + v] * corr + pr * static_cast<float>(vp[i].x[v]);
                }
            }
            m[r] = nm;
        }
    }

    // Merge the warp's TOKENS lane groups: lanes s, s + G, s + 2G, ... hold the same slice.
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        #pragma unroll
        for (int o = G; o < 32; o <<= 1) {
            const float om = __shfl_xor_sync(0xffffffff, m[r], o);
            const float ol = __shfl_xor_sync(0xffffffff, l[r], o);
            const float nm = fmaxf(m[r], om);
            const float c1 = nm == NEG_INF ? 0.f : __expf(m[r] - nm);
            const float c2 = nm == NEG_INF ? 0.f : __expf(om - nm);
            l[r] = l[r] * c1 + ol * c2;
            #pragma unroll
            for (int e = 0; e < E; ++e) {
                const float oa = __shfl_xor_sync(0xffffffff, acc[r][e], o);
                acc[r][e] = acc[r][e] * c1 + oa * c2;
            }
            m[r] = nm;
        }
    }

"""
_GROUP_CONSTANTS = """\
    constexpr int G = LANES_PER_TOKEN;     // lanes per token
    constexpr int E = D / G;               // elements of a row per lane
    constexpr int V = 16 / sizeof(T);      // elements per 16-byte load
    constexpr int NV = E / V;              // loads per row and lane
    constexpr int TOKENS = 32 / G;         // tokens a warp scores at once
    struct alignas(16) Pack { T x[V]; };"""
_MAIN_LOOP = "    for (int j0 = start + warp * U; j0 < end; j0 += WARPS * U) {"
_WARP_STATE = "    __shared__ float sm_m[WARPS][REP];"


def _replaced(src: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for old, new in pairs:
        if old not in src:
            raise RuntimeError(f"the kernel's source changed; update bench.kernel_sweep: {old[:40]!r}")
        src = src.replace(old, new)
    return src


def group_source(lanes: int = 8) -> str:
    """The paged kernel with `lanes` lanes per token (see the module's docstring): the
    engine kernel's set-up, with a lane's slice of D/lanes elements, then its own loop and
    the lane groups' merge, then the engine kernel's merge of the warps (only the first
    group's lanes hold the whole row) and its writes."""
    src = cuda_decode._SOURCE
    for marker in (_MAIN_LOOP, _WARP_STATE):
        if marker not in src:
            raise RuntimeError(f"the kernel's source changed; update bench.kernel_sweep: {marker[:40]!r}")
    head = _replaced(src[: src.index(_MAIN_LOOP)], (
        ("    constexpr int E = D / 32;", _GROUP_CONSTANTS.replace("LANES_PER_TOKEN", str(lanes))),
        ("* D + lane * E;", "* D + (lane % G) * E;"),
    ))
    tail = _replaced(src[src.index(_WARP_STATE):], (
        ("        for (int e = 0; e < E; ++e) sm_acc[warp][r][lane * E + e] = acc[r][e];",
         "        for (int e = 0; e < E; ++e) if (lane < G) sm_acc[warp][r][lane * E + e] = acc[r][e];"),
    ))
    return head + _GROUP_LOOP + tail


_ENGINE_BLOCK = """\
    for (int j0 = start + warp * U; j0 < end; j0 += WARPS * U) {
        // U consecutive tokens per warp step: U % BS == 0 and j0 % U == 0 put them in one
        // block, and their loads are all in flight before the first score is needed.
        const int blk = table[b * nb + j0 / BS];"""
_ENGINE_BLOCK_PREFETCHED = """\
    int pre = 0;
    int k = 0;
    for (int j0 = start + warp * U; j0 < end; j0 += WARPS * U, ++k) {
        // The next 32 steps' block ids in one load, lane i holding step k + i's, so the
        // K/V loads no longer wait on a table load of their own.
        if ((k & 31) == 0) {
            const int jl = j0 + lane * WARPS * U;
            pre = jl < end ? table[b * nb + jl / BS] : 0;
        }
        const int blk = __shfl_sync(0xffffffff, pre, k & 31);"""
_PERHEAD_BLOCK = """\
    for (int j = s * WARPS + warp; j < len; j += S * WARPS) {
        const int blk = table[b * nb + j / BS];"""
_PERHEAD_BLOCK_PREFETCHED = """\
    int pre = 0;
    int k = 0;
    for (int j = s * WARPS + warp; j < len; j += S * WARPS, ++k) {
        if ((k & 31) == 0) {
            const int jl = j + lane * S * WARPS;
            pre = jl < len ? table[b * nb + jl / BS] : 0;
        }
        const int blk = __shfl_sync(0xffffffff, pre, k & 31);"""


def prefetch_source() -> str:
    """The engine's kernel with its block ids loaded 32 steps at a time (session 13's
    hypothesis): at batch 1 each warp step's K/V loads waited on a table load of their own,
    two memory latencies in a row per step, where `sdpa_vector` has one."""
    return _replaced(cuda_decode._SOURCE, ((_ENGINE_BLOCK, _ENGINE_BLOCK_PREFETCHED),))


def perhead_prefetch_source() -> str:
    """`bench.kernel_perhead`'s layout with the same prefetch: that layout is `sdpa_vector`'s
    but for the table, so this alone separates the table's latency from everything else."""
    return _replaced(kernel_perhead.SOURCE, ((_PERHEAD_BLOCK, _PERHEAD_BLOCK_PREFETCHED),))


def group_fits(lanes: int, dtype: mx.Dtype, head_dim: int) -> bool:
    """A lane's D/lanes elements must fill whole 16-byte loads."""
    per_lane_bytes = head_dim // lanes * dtype.size
    return head_dim % lanes == 0 and per_lane_bytes >= 16 and per_lane_bytes % 16 == 0


SOURCES: dict[str, tuple[str, Callable[[], str], Callable[[mx.Dtype, int], bool]]] = {
    "scalar": ("headroom_paged_decode", lambda: cuda_decode._SOURCE, lambda dt, d: True),
    "vector": ("headroom_paged_decode_vector", vector_source,
               lambda dt, d: (d // 32 * dt.size) in (2, 4, 8, 16)),
    "group": ("headroom_paged_decode_group", group_source, lambda dt, d: group_fits(8, dt, d)),
    "group16": ("headroom_paged_decode_group16", lambda: group_source(16),
                lambda dt, d: group_fits(16, dt, d)),
    "perhead": ("headroom_paged_decode_perhead", lambda: kernel_perhead.SOURCE, lambda dt, d: True),
    "prefetch": ("headroom_paged_decode_prefetch", prefetch_source, lambda dt, d: True),
    "perhead_prefetch": ("headroom_paged_decode_perhead_prefetch", perhead_prefetch_source,
                         lambda dt, d: True),
}
# A source kind with a launch of its own (grid, warps per block); the others take the engine's.
_ENGINE_LAUNCH = (cuda_decode._launch, cuda_decode.WARPS)
_LAUNCHES = {"perhead": (kernel_perhead.launch, kernel_perhead.WARPS),
             "perhead_prefetch": (kernel_perhead.launch, kernel_perhead.WARPS)}


def launch_of(kind: str) -> tuple[Callable[..., cuda_decode._Launch], int]:
    """The launch function and warps per block that source `kind` runs with."""
    return _LAUNCHES.get(kind, _ENGINE_LAUNCH)


def _use_source(kind: str) -> None:
    """Swap the kernel the engine's `paged_decode` launches (a new name: MLX caches by it)."""
    name, build, _ = SOURCES[kind]
    built: list[object] = []

    def get_kernel() -> object:  # built on first use, as the engine's own (none on the CPU)
        if not built:
            built.append(cuda_decode.build_kernel(name, build()))
        return built[0]

    cuda_decode._get_kernel = get_kernel


# name, partition sizes, target blocks, tokens per warp step, kernel source, merge
VARIANTS = [("current", BASE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, "scalar", "serial"),
            ("vector", BASE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, "vector", "serial"),
            ("group", BASE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, "group", "serial"),
            ("group_target4k", BASE, 4224, 4, "group", "serial"),
            ("group_fine_target4k", FINE, 4224, 4, "group", "serial"),
            ("group16", BASE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, "group16", "serial"),
            ("group16_target4k", BASE, 4224, 4, "group16", "serial"),
            ("vector_unroll8", BASE, 1056, 8, "vector", "serial"),
            ("vector_unroll16", BASE, 1056, 16, "vector", "serial"),
            ("vector_target4k", BASE, 4224, 4, "vector", "serial"),
            ("vector_fine_target4k", FINE, 4224, 4, "vector", "serial"),
            ("target4k", BASE, 4224, 4, "scalar", "serial"), ("unroll8", BASE, 1056, 8, "scalar", "serial"),
            # Session 11's: the partitions' merge spread over lanes (bench.kernel_merge), with the
            # engine's partitions, then with finer ones at batch 1 (16 or 32 tokens at 1,100).
            ("pmerge", BASE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, "scalar", "lanes"),
            ("pmerge_fine", FINE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, "scalar", "lanes"),
            ("pmerge_fine528", FINE, 528, cuda_decode.UNROLL, "scalar", "lanes"),
            # The same with one packed load per lane (the `vector` source): its loads were 73 %
            # excess sectors under ncu at batch 1.
            ("pmerge_vec", BASE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, "vector", "lanes"),
            ("pmerge_vec_fine", FINE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, "vector", "lanes"),
            # Session 12's: sdpa_vector's layout over the block table (bench.kernel_perhead).
            ("perhead", BASE, cuda_decode.TARGET_BLOCKS, 1, "perhead", "serial"),
            ("perhead_lanes", BASE, cuda_decode.TARGET_BLOCKS, 1, "perhead", "lanes"),
            # Session 13's: block ids loaded 32 steps at a time (`prefetch_source`).
            ("prefetch", BASE, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, "prefetch", "serial"),
            ("perhead_prefetch", BASE, cuda_decode.TARGET_BLOCKS, 1, "perhead_prefetch", "serial")]
MERGES: dict[str, Callable[..., mx.array]] = {"serial": cuda_decode.merge_partitions,
                                             "lanes": kernel_merge.merge_partitions}


def use_variant(name: str, dtype: mx.Dtype | None = None, head_dim: int | None = None) -> str:
    """Make the engine's `paged_decode` launch variant `name` (its launch settings and its
    source) from now on, in this process; returns the variant's source kind. With `dtype`
    and `head_dim`, refuses a variant that cannot take that shape."""
    for v_name, parts, target, unroll, kind, merge in VARIANTS:
        if v_name != name:
            continue
        if dtype is not None and head_dim is not None and not SOURCES[kind][2](dtype, head_dim):
            raise ValueError(f"kernel variant {name} cannot take {dtype} at head_dim {head_dim}")
        cuda_decode.PARTITIONS, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL = parts, target, unroll
        cuda_decode._launch, cuda_decode.WARPS = launch_of(kind)
        cuda_decode._launch.cache_clear()
        cuda_decode.merge_partitions = MERGES[merge]
        _use_source(kind)
        return kind
    raise ValueError(f"no kernel variant {name!r}; there are {[v[0] for v in VARIANTS]}")


# dtype, batch, query heads, head dim, lengths: ragged rows, one token, several partitions
CHECKS = ((mx.bfloat16, 5, 32, 128, [1, 17, 300, 1024, 4099]), (mx.float16, 3, 8, 64, [2, 513, 40]),
          (mx.float32, 64, 32, 128, ragged(64, 1000)))


def time_attention(batch: int, length: int, layers: int = 32) -> dict[str, object]:
    """32 layers of the kernel and its merge at `length` tokens per row, and the KV
    bandwidth that reached (`bench.kv_store.attention_only`, kernel only)."""
    ms = attention_only(mx.bfloat16, batch, length, layers, lengths=[length] * batch,
                        paths=("kernel",))["kernel_ms"]
    kv_bytes = batch * length * 8 * 128 * 2 * 2 * layers
    split = cuda_decode.partition_split(batch, 8, length)
    launch = cuda_decode._launch(batch, 32, 8, 128, *split, mx.bfloat16, 16, cuda_decode.UNROLL)
    # the partitions the launched kernel writes: a layout of its own (bench.kernel_perhead) has
    # its own count, whatever the engine's split says
    return {"ms": ms, "gb_s": round(kv_bytes / (ms / 1e3) / 1e9), "split": split,
            "partitions": launch.output_shapes[1][-1],
            "blocks": launch.grid[0] // (32 * cuda_decode.WARPS) * launch.grid[1]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=1100)
    p.add_argument("--batch", default="1,32,64")
    p.add_argument("--only", help="comma list of variant names, run in that order, repeats allowed "
                   "(interleave A/B: current,vector,vector,current); default: all, once each")
    args = p.parse_args()
    known = [name for name, *_ in VARIANTS]
    names = args.only.split(",") if args.only else known
    if unknown := sorted(set(names) - set(known)):
        p.error(f"unknown variants {unknown}; known: {known}")
    for name in names:
        row: dict[str, object] = {"variant": name}
        try:
            fits = SOURCES[use_variant(name)][2]
            row["max_abs_err"] = max(
                kernel_vs_plain(dt, b, hq, 8, d, lengths)["max_abs_err"]
                for dt, b, hq, d, lengths in CHECKS if fits(dt, d))
            for b in (int(x) for x in args.batch.split(",")):
                row[f"b{b}"] = time_attention(b, args.context)
        except Exception as exc:  # a variant that fails to build or run: report it, go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
