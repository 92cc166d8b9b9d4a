"""`bench.kernel_perhead`, the paged kernel in `sdpa_vector`'s layout: its launches, recorded on
the CPU (it runs on CUDA only; `bench.kernel_sweep` checks its numbers against the plain path
on the H200 before it times it), and its swap in and out of the engine's `paged_decode`."""

from __future__ import annotations

import mlx.core as mx
import pytest

from bench import kernel_merge, kernel_perhead, kernel_sweep
from engine.kv import cuda_decode


@pytest.mark.parametrize(("batch", "q_heads", "slices"), [(1, 32, 32), (2, 32, 16), (32, 32, 1), (64, 32, 1),
                                                          (1, 8, 32), (3, 28, 12)])
def test_slices_fill_a_grid_of_about_a_thousand_blocks(batch: int, q_heads: int, slices: int) -> None:
    assert kernel_perhead.slices(batch, q_heads) == slices
    launch = kernel_perhead.launch(batch, q_heads, 8 if q_heads % 8 == 0 else 4, 128, 64, 18,
                                   mx.bfloat16, 16, 4)
    # MLX's grid counts threads: one block of WARPS warps per (row, query head, slice)
    assert launch.grid == (32 * kernel_perhead.WARPS * batch * q_heads, slices, 1)
    assert launch.output_shapes == [(batch, q_heads, slices, 128), (batch, q_heads, slices),
                                    (batch, q_heads, slices)]
    assert dict(launch.template)["WARPS"] == kernel_perhead.WARPS


def test_the_launch_refuses_what_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        kernel_perhead.launch(1, 32, 8, 80, 64, 18, mx.bfloat16, 16, 4)


def test_a_variant_swaps_the_launch_and_the_next_one_puts_the_engines_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`paged_decode` sizes its blocks by `cuda_decode.WARPS`: a launch of 8-warp blocks for
    a kernel of 4 warps (or the reverse) would read past its shared memory."""
    for name in ("PARTITIONS", "TARGET_BLOCKS", "UNROLL", "WARPS", "_launch", "_get_kernel",
                 "merge_partitions"):
        monkeypatch.setattr(cuda_decode, name, getattr(cuda_decode, name))
    engine_launch, engine_warps = cuda_decode._launch, cuda_decode.WARPS
    kernel_sweep.use_variant("perhead_lanes")
    assert cuda_decode._launch is kernel_perhead.launch
    assert cuda_decode.WARPS == kernel_perhead.WARPS == 8
    assert cuda_decode.merge_partitions is kernel_merge.merge_partitions
    kernel_sweep.use_variant("current")
    assert cuda_decode._launch is engine_launch and cuda_decode.WARPS == engine_warps == 4
