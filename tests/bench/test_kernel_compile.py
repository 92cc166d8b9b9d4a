"""Our CUDA kernels compile (NVRTC, sm_90) on a machine without a GPU, without spills: a
mistake in `engine/kv/cuda_decode.py` fails here rather than on the first CUDA request."""

from __future__ import annotations

import pytest

from bench import kernel_merge, kernel_sweep
from bench.kernel_compile import CUDA_TYPES, Nvrtc, merge_kernel_source, nvrtc_paths, paged_kernel_source
from engine.kv import cuda_decode

PATHS = nvrtc_paths()
pytestmark = pytest.mark.skipif(PATHS is None, reason="the NVRTC wheels are Linux-only (the test extra)")


@pytest.fixture(scope="module")
def nvrtc() -> Nvrtc:
    assert PATHS is not None
    return Nvrtc(*PATHS)


@pytest.mark.parametrize("dtype", sorted(CUDA_TYPES))
@pytest.mark.parametrize("unroll", sorted({1, cuda_decode.UNROLL}))
def test_the_engine_paged_kernel_compiles_without_spills(nvrtc: Nvrtc, dtype: str, unroll: int) -> None:
    result = nvrtc.compile(paged_kernel_source(cuda_decode._SOURCE, dtype, unroll=unroll))
    assert result.ok, result.log
    assert result.spill_bytes == 0 and result.registers is not None and result.registers <= 255


@pytest.mark.parametrize("dtype", sorted(CUDA_TYPES))
def test_the_engine_merge_kernel_compiles(nvrtc: Nvrtc, dtype: str) -> None:
    result = nvrtc.compile(merge_kernel_source(dtype))
    assert result.ok, result.log


@pytest.mark.parametrize("dtype", sorted(CUDA_TYPES))
@pytest.mark.parametrize(("head_dim", "parts"), [(128, 1), (128, 69), (256, 69), (64, 5)])
def test_the_lanes_merge_compiles_at_the_lanes_it_launches(nvrtc: Nvrtc, dtype: str, head_dim: int,
                                                           parts: int) -> None:
    """`bench.kernel_merge` is session 11's variant, never run on a GPU yet: at least it
    compiles at each lane count its launch picks."""
    lanes = kernel_merge.merge_lanes(parts, head_dim)
    result = nvrtc.compile(merge_kernel_source(dtype, head_dim, kernel_merge._SOURCE, LANES=lanes))
    assert result.ok, result.log


@pytest.mark.parametrize("kind", sorted(kernel_sweep.SOURCES))
def test_every_sweep_variant_compiles(nvrtc: Nvrtc, kind: str) -> None:
    _, build, _ = kernel_sweep.SOURCES[kind]
    _, warps = kernel_sweep.launch_of(kind)  # as it is launched
    result = nvrtc.compile(paged_kernel_source(build(), "bfloat16", warps=warps))
    assert result.ok, result.log


def test_a_broken_source_is_reported_with_its_error(nvrtc: Nvrtc) -> None:
    broken = cuda_decode._SOURCE.replace("const int nb = table_shape[1];", "const int nb = table_shape[1]")
    result = nvrtc.compile(paged_kernel_source(broken, "bfloat16"))
    assert not result.ok and "error" in result.log


def test_the_packed_loads_are_vector_loads_in_the_ptx(nvrtc: Nvrtc) -> None:
    scalar = nvrtc.ptx_ops(paged_kernel_source(cuda_decode._SOURCE, "bfloat16", unroll=4))
    vector = nvrtc.ptx_ops(paged_kernel_source(kernel_sweep.vector_source(), "bfloat16", unroll=4))
    assert "ld.global.v4.u16" not in scalar and vector["ld.global.v4.u16"] == 8  # 4 tokens x (K, V)
