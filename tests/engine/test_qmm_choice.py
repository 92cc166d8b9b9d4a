"""The small-M quantized kernel's launch plan and where the engine may take it.

The kernel itself runs on CUDA only: `bench/qmm_check.py` checks its numbers against MLX's
on a GPU, and tests/engine/test_kernel_compile.py compiles every variant with NVRTC here.
These tests pin what the host side decides."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from engine import load_model, qmm_cuda
from engine.qmm_choice import POINTS, ShapeChoice, eligible, point_for
from engine.quantized import FlatQuantizedLinear


@pytest.mark.parametrize(("rows", "tiles"),
                         [(1, 1), (8, 1), (9, 2), (16, 2), (17, 4), (32, 4), (33, 8), (64, 8)])
def test_a_row_count_takes_the_smallest_tile_that_holds_it(rows: int, tiles: int) -> None:
    assert qmm_cuda.plan(rows, 4096, 28672).row_tiles == tiles


def test_too_many_rows_are_refused() -> None:
    with pytest.raises(ValueError, match=r"1\.\.64 rows"):
        qmm_cuda.plan(65, 4096, 4096)


def test_wide_weights_run_whole_and_narrow_ones_split_k_into_parts_of_at_least_512() -> None:
    wide = qmm_cuda.plan(32, 4096, 28672)  # 448 blocks of 64 channels: enough for the card
    assert wide.split == 1 and wide.grid == (448 * 32 * qmm_cuda.NPB, 1, 1)
    narrow = qmm_cuda.plan(32, 4096, 4096)  # 64 blocks: split K until 264 blocks or 512 per part
    assert narrow.split == 8 and narrow.grid[1] == 8
    long_k = qmm_cuda.plan(32, 14336, 4096)  # a down projection
    assert long_k.split == 8 and 14336 % (64 * long_k.split) == 0
    assert qmm_cuda.plan(32, 4096, 4096, target_blocks=128).split == 2
    assert qmm_cuda.plan(8, 1024, 256).split == 2  # never below 512 of K per part


def test_a_row_count_is_judged_at_the_smallest_timed_point_above_it() -> None:
    assert [point_for(r) for r in (1, 2, 8, 9, 16, 17, 33, 64)] == [1, 8, 8, 16, 16, 32, 64, 64]
    choice = ShapeChoice(4096, 4096, 4, 64, ours_us=(9, 5, 6, 7, 9), mlx_us=(6, 8, 12, 20, 30))
    assert choice.points == frozenset(POINTS[1:])  # MLX's one-row product won at one row


@pytest.fixture(scope="module")
def quantized_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("quantized-choice") / "tiny-4bit-g64"
    convert(str(tiny_model_path), str(out), quantize=True, q_group_size=64, q_bits=4,
            dtype="bfloat16")
    return load_model(str(out), model_id="tiny-4bit-g64").model


def test_the_flattened_projections_of_a_4_bit_model_are_eligible_and_untimed_here(quantized_model) -> None:
    flat = [m for _, m in quantized_model.named_modules() if isinstance(m, FlatQuantizedLinear)]
    assert flat and all(m.small_m_points == frozenset() for m in flat)  # timed on CUDA only
    shapes = {m["weight"].shape for m in flat if eligible(m)}
    assert shapes, "no projection of a bf16 4-bit model can take the kernel"
    assert all(s[1] * 32 // 4 % 64 == 0 for s in shapes)


def test_a_float32_scaled_weight_is_not_eligible(tiny_model_path: Path, tmp_path: Path) -> None:
    from mlx_lm import convert

    out = tmp_path / "tiny-4bit-f32"
    convert(str(tiny_model_path), str(out), quantize=True, q_group_size=64, q_bits=4, dtype="float32")
    model = load_model(str(out), model_id="tiny-4bit-f32").model
    flat = [m for _, m in model.named_modules() if isinstance(m, FlatQuantizedLinear)]
    assert flat and all(m["scales"].dtype == mx.float32 and not eligible(m) for m in flat)
