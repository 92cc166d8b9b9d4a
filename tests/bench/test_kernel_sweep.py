"""bench.kernel_sweep's packed-load variant is derived from the engine's kernel source: if
that source changes under it, the sweep must say so rather than time a stale kernel."""

from __future__ import annotations

import pytest

from bench import kernel_sweep
from engine.kv import cuda_decode


def test_the_vector_variant_replaces_every_scalar_load_and_use() -> None:
    src = kernel_sweep.vector_source()
    assert "kv[u]" not in src and "vv[u]" not in src
    assert src.count("reinterpret_cast<const Pack*>") == 2
    assert "static_cast<float>(kp[u].x[e])" in src and "static_cast<float>(vp[u].x[e])" in src


def test_a_changed_kernel_source_stops_the_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    changed = cuda_decode._SOURCE.replace("float kv[U][E];", "float k[U][E];")
    monkeypatch.setattr(cuda_decode, "_SOURCE", changed)
    with pytest.raises(RuntimeError, match="kernel's source changed"):
        kernel_sweep.vector_source()


@pytest.mark.parametrize("lanes", [8, 16])
def test_the_group_variant_keeps_the_engine_kernels_set_up_and_writes(lanes: int) -> None:
    src = kernel_sweep.group_source(lanes)
    assert f"constexpr int G = {lanes};" in src and "constexpr int E = D / 32;" not in src
    assert "(lane % G) * E" in src and "if (lane < G) sm_acc" in src
    tail = cuda_decode._SOURCE[cuda_decode._SOURCE.index("    for (int idx = threadIdx.x"):]
    assert src.endswith(tail)  # the warps' merge and the writes are the engine kernel's own


def test_a_variant_that_cannot_take_the_models_shape_is_refused_before_anything_changes() -> None:
    import mlx.core as mx

    before = (cuda_decode.PARTITIONS, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL, cuda_decode._get_kernel,
              cuda_decode.merge_partitions)
    with pytest.raises(ValueError, match="cannot take"):
        kernel_sweep.use_variant("group16", mx.float32, 32)  # 2 elements per lane: no 16-byte load
    with pytest.raises(ValueError, match="no kernel variant"):
        kernel_sweep.use_variant("nosuch")
    assert (cuda_decode.PARTITIONS, cuda_decode.TARGET_BLOCKS, cuda_decode.UNROLL,
            cuda_decode._get_kernel, cuda_decode.merge_partitions) == before
