"""`bench.kernel_merge`, the lanes' merge of the paged kernel's partitions: its launches,
recorded on the CPU (the kernel runs on CUDA only; `bench.kernel_sweep` checks its numbers
against the plain path on the H200 before it times it), and its swap in and out of the
engine's `paged_decode` by `bench.kernel_sweep.use_variant`."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from bench import kernel_merge, kernel_sweep
from engine.kv import cuda_decode


@pytest.mark.parametrize(("parts", "head_dim", "lanes"),
                         [(1, 128, 1), (2, 128, 2), (17, 128, 8), (69, 128, 8), (69, 256, 4), (5, 64, 8)])
def test_lanes_share_the_partitions_within_a_blocks_threads(parts: int, head_dim: int, lanes: int) -> None:
    assert kernel_merge.merge_lanes(parts, head_dim) == lanes
    launch = kernel_merge.merge_launch(3, 32, parts, head_dim, mx.bfloat16)
    assert launch["threadgroup"] == (head_dim, lanes, 1)
    assert head_dim * lanes <= kernel_merge.MAX_THREADS
    # MLX's grid counts threads: one block per (row, query head)
    assert launch["grid"] == (head_dim * 3 * 32, lanes, 1)
    assert dict(launch["template"]) == {"T": mx.bfloat16, "D": head_dim, "LANES": lanes}
    assert launch["output_shapes"] == [(3, 32, 1, head_dim)] and launch["output_dtypes"] == [mx.bfloat16]


def test_the_merge_reads_the_engine_merges_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        calls.append({"inputs": [tuple(i.shape) for i in inputs], "grid": grid})
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

    monkeypatch.setattr(kernel_merge, "_get_kernel", lambda: kernel)
    out, m = mx.zeros((2, 8, 17, 128)), mx.zeros((2, 8, 17))
    y = kernel_merge.merge_partitions(out, m, m, mx.float16)
    assert calls == [{"inputs": [(2, 8, 17, 128), (2, 8, 17), (2, 8, 17)], "grid": (128 * 16, 8, 1)}]
    assert y.shape == (2, 8, 1, 128) and y.dtype == mx.float16
    assert "m_shape[2]" in kernel_merge._SOURCE  # P is m's last axis, as in the engine's merge


def test_a_variant_swaps_the_merge_and_the_next_one_puts_the_engines_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PARTITIONS", "TARGET_BLOCKS", "UNROLL", "_get_kernel", "merge_partitions"):
        monkeypatch.setattr(cuda_decode, name, getattr(cuda_decode, name))
    engine_merge = cuda_decode.merge_partitions
    kernel_sweep.use_variant("pmerge_fine")
    assert cuda_decode.merge_partitions is kernel_merge.merge_partitions
    assert cuda_decode.partition_split(1, 8, 1100) == (16, 69)
    kernel_sweep.use_variant("current")
    assert cuda_decode.merge_partitions is engine_merge
    assert cuda_decode.partition_split(1, 8, 1100) == (64, 18)
    cuda_decode._launch.cache_clear()


def test_the_lanes_merge_is_built_under_its_own_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX caches a compiled kernel by name: the engine's merge name would launch the
    engine's merge."""
    built: list[tuple[str, str]] = []
    monkeypatch.setattr(kernel_merge, "_kernel", [])
    monkeypatch.setattr(cuda_decode, "build_merge_kernel",
                        lambda name, source: built.append((name, source)) or name)
    assert kernel_merge._get_kernel() == kernel_merge._get_kernel() == "headroom_paged_decode_merge_lanes"
    assert built == [("headroom_paged_decode_merge_lanes", kernel_merge._SOURCE)]
