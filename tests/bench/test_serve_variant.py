"""`bench.serve_variant` / `bench.run --ours-kernel-variant`: our server with a kernel
variant, for a server A/B before the variant moves into the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import run, serve_variant
from engine.kv import cuda_decode


def test_an_unknown_variant_is_refused_with_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_variant.main(["nope", "serve"]) == 2
    assert "vector" in capsys.readouterr().err


def test_the_variant_is_built_when_the_engine_first_launches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without CUDA the server never launches the kernel, so choosing a variant
    must not build it (MLX refuses a CUDA kernel there)."""
    for name in ("PARTITIONS", "TARGET_BLOCKS", "UNROLL", "_get_kernel"):
        monkeypatch.setattr(cuda_decode, name, getattr(cuda_decode, name))
    built: list[str] = []
    monkeypatch.setattr(cuda_decode, "build_kernel", lambda name, source: built.append(name) or name)
    serve_variant.kernel_sweep.use_variant("vector")
    assert built == []
    assert cuda_decode._get_kernel() == "headroom_paged_decode_vector"
    assert cuda_decode._get_kernel() == "headroom_paged_decode_vector"
    assert built == ["headroom_paged_decode_vector"]
    cuda_decode._launch.cache_clear()


def test_the_bench_starts_ours_through_the_variant_launcher(tmp_path: Path) -> None:
    plain = run._ours(tmp_path, {}, "tiny", "float32", [])
    chosen = run._ours(tmp_path, {}, "tiny", "float32", [], kernel_variant="vector")
    assert plain.args[:2] == ["server.cli", "serve"]
    assert chosen.args[:3] == ["bench.serve_variant", "vector", "serve"]
    assert chosen.args[3:] == plain.args[2:]
