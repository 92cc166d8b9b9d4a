"""The paged decode kernel's launches, recorded on the CPU (the kernels run on CUDA only;
tests/engine/test_kernel_compile.py compiles them with NVRTC): one attention launch
and one merge launch per layer, shaped from the batch, heads and the partition."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from engine.kv import cuda_decode


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def fake(name: str):
        def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            calls.append({"name": name, "inputs": [tuple(i.shape) for i in inputs],
                          "template": dict(template), "grid": grid, "threadgroup": threadgroup,
                          "outputs": list(output_shapes), "dtypes": list(output_dtypes)})
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        return lambda: kernel

    monkeypatch.setattr(cuda_decode, "_get_kernel", fake("attend"))
    monkeypatch.setattr(cuda_decode, "_get_merge_kernel", fake("merge"))
    return calls


def test_one_attention_and_one_merge_launch_shaped_by_the_partition(launches):
    b, hq, h, d, max_len = 5, 32, 8, 128, 1000
    q = mx.zeros((b, hq, 1, d), mx.bfloat16)
    pool = mx.zeros((4096, h, d), mx.bfloat16)
    y = cuda_decode.paged_decode(q, pool, pool, mx.zeros((b, 64), mx.int32), mx.ones((b,), mx.int32),
                                 max_len, 0.088, 16)
    part = cuda_decode.partition_tokens(b, h, max_len)
    parts = -(-max_len // part)
    attend, merge = launches
    assert attend["name"] == "attend" and merge["name"] == "merge"
    assert attend["template"] == {"T": mx.bfloat16, "D": d, "H": h, "REP": hq // h, "BS": 16,
                                  "WARPS": cuda_decode.WARPS, "U": cuda_decode.UNROLL}
    assert attend["grid"] == (32 * cuda_decode.WARPS * b * h, parts, 1)
    assert attend["outputs"] == [(b, hq, parts, d), (b, hq, parts), (b, hq, parts)]
    # the merge reads the partitions on the last axis of m and l, and writes the model's dtype
    assert merge["inputs"] == [(b, hq, parts, d), (b, hq, parts), (b, hq, parts)]
    assert merge["grid"] == (d * b * hq, 1, 1) and merge["threadgroup"] == (d, 1, 1)
    assert merge["outputs"] == [(b, hq, 1, d)] and merge["dtypes"] == [mx.bfloat16]
    assert y.shape == (b, hq, 1, d) and y.dtype == mx.bfloat16
    assert "m_shape[2]" in cuda_decode._MERGE_SOURCE  # P is m's last axis ([B, Hq, P])


def test_a_block_size_the_unroll_does_not_divide_takes_one_token_per_step(launches):
    q = mx.zeros((2, 8, 1, 64), mx.float16)
    pool = mx.zeros((512, 8, 64), mx.float16)
    cuda_decode.paged_decode(q, pool, pool, mx.zeros((2, 20), mx.int32), mx.ones((2,), mx.int32),
                             100, 0.125, 6)
    assert launches[0]["template"]["U"] == 1


def test_shapes_the_kernel_cannot_take_are_refused():
    q = mx.zeros((2, 8, 1, 48), mx.float16)  # head_dim not a multiple of 32
    pool = mx.zeros((512, 8, 48), mx.float16)
    with pytest.raises(ValueError, match="head_dim"):
        cuda_decode.paged_decode(q, pool, pool, mx.zeros((2, 4), mx.int32), mx.ones((2,), mx.int32),
                                 10, 0.1, 16)
