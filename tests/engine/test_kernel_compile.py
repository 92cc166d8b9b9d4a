"""Our CUDA kernels compile (NVRTC, sm_90) on a machine without a GPU, without spills: a
mistake in `engine/kv/cuda_decode.py` fails here rather than on the first CUDA request.

MLX compiles a `mx.fast.cuda_kernel` with NVRTC the first time it runs, so a mistake in a
kernel's source only shows on a GPU. The `nvidia-cuda-nvrtc-cu12` and
`nvidia-cuda-runtime-cu12` wheels (the `kernels` and `test` extras; Linux only) compile the
same source here. The wrapper copies the one MLX writes (`mlx/backend/cuda/custom_kernel.cpp`,
`build_kernel`): inputs as `const T*`, a `Shape` for each input whose `<name>_shape` the source
uses, outputs, then the template arguments as `constexpr int` / `using` lines. MLX's own device
header is not available here, so `Shape` is a stand-in with the same indexing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest

from engine import qmm_cuda
from engine.kv import cuda_decode
from engine.kv.quant import KVQuant

CUDA_TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}
PRELUDE = r"""
typedef unsigned int uint32_t;
#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct Shape { int data[8]; __device__ int operator[](int i) const { return data[i]; } };
"""


@dataclass(frozen=True)
class Compiled:
    ok: bool
    log: str
    registers: int | None
    spill_bytes: int | None


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def nvrtc_paths() -> tuple[Path, Path] | None:
    """(libnvrtc, the CUDA runtime's include folder) from the pip wheels, or None."""
    nvrtc, runtime = _package_dir("nvidia.cuda_nvrtc"), _package_dir("nvidia.cuda_runtime")
    if nvrtc is None or runtime is None:
        return None
    libs = sorted((nvrtc / "lib").glob("libnvrtc.so.*"))
    return (libs[0], runtime / "include") if libs else None


def paged_kernel_source(source: str, dtype: str, *, head_dim: int = 128, kv_heads: int = 8, rep: int = 4,
                        block_size: int = 16, unroll: int = cuda_decode.UNROLL,
                        warps: int = cuda_decode.WARPS, ring: bool = False,
                        quant: KVQuant | None = None) -> str:
    """`source` (the body `cuda_decode` hands MLX) wrapped as MLX wraps it; `ring`: with the
    window variant's two inputs; `quant`: pools of quantized rows, with their constants."""
    t = CUDA_TYPES[dtype]
    extra = "const int* first, const int* ring, " if ring else ""
    pool = t if quant is None else "uint32_t"
    signature = (f"__global__ void paged(const {t}* q, const {pool}* k_pool, const {pool}* v_pool, "
                 "const int* table, const __grid_constant__ Shape table_shape, const int* lengths, "
                 f"const float* scale, const int* part, {extra}float* out, float* out_m, float* out_l) {{\n")
    consts = {"D": head_dim, "H": kv_heads, "REP": rep, "BS": block_size, "WARPS": warps,
              "U": unroll}
    if quant is not None:
        consts |= {"BITS": quant.bits, "GS": quant.group_size, "PW": quant.packed_words,
                   "NG": quant.groups, "RW": quant.row_words}
    body = f"  using T = {t};\n" + "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
    return PRELUDE + cuda_decode._HEADER + signature + body + source + "\n}\n"


def merge_kernel_source(dtype: str, head_dim: int = 128, *, sinks: bool = False) -> str:
    """The partitions' merge wrapped as MLX wraps it; `sinks`: the variant with sink logits."""
    t = CUDA_TYPES[dtype]
    extra = "const float* sinks, " if sinks else ""
    signature = ("__global__ void merge(const float* part_out, const float* m, "
                 f"const __grid_constant__ Shape m_shape, const float* l, {extra}{t}* y) {{\n")
    consts = f"  constexpr int D = {head_dim};\n" + ("  constexpr int HQ = 32;\n" if sinks else "")
    source = cuda_decode._SINKS_MERGE_SOURCE if sinks else cuda_decode._MERGE_SOURCE
    return PRELUDE + cuda_decode._HEADER + signature + f"  using T = {t};\n" + consts + source + "\n}\n"


class Nvrtc:
    def __init__(self, library: Path, include: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.include = include

    def compile(self, code: str) -> Compiled:
        """Compiled for sm_90 (the H200), with ptxas's resource report."""
        prog = ctypes.c_void_p()
        if self.lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"kernel.cu", 0, None, None) != 0:
            raise RuntimeError("nvrtcCreateProgram failed")
        options = ("--gpu-architecture=sm_90", "--ptxas-options=-v", "-std=c++17", "-diag-suppress=177",
                   f"-I{self.include}")
        opts = [o.encode() for o in options]
        rc = self.lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, buf)
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        log = buf.value.decode(errors="replace")
        regs = re.search(r"Used (\d+) registers", log)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        return Compiled(rc == 0, log, int(regs.group(1)) if regs else None,
                        sum(int(s) for s in spills) if spills else None)


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
def test_the_window_layers_ring_kernel_compiles_without_spills(nvrtc: Nvrtc, dtype: str) -> None:
    assert cuda_decode._RING_SOURCE.count("% rb") == 1 and cuda_decode._RING_SOURCE.count(">= lo") == 2
    result = nvrtc.compile(paged_kernel_source(cuda_decode._RING_SOURCE, dtype, ring=True))
    assert result.ok, result.log
    assert result.spill_bytes == 0 and result.registers is not None and result.registers <= 255


@pytest.mark.parametrize("dtype", sorted(CUDA_TYPES))
@pytest.mark.parametrize("sinks", [False, True])
def test_the_engine_merge_kernel_compiles(nvrtc: Nvrtc, dtype: str, sinks: bool) -> None:
    if sinks:
        assert cuda_decode._SINKS_MERGE_SOURCE.count("top") == 3
    result = nvrtc.compile(merge_kernel_source(dtype, sinks=sinks))
    assert result.ok, result.log


def test_a_broken_source_is_reported_with_its_error(nvrtc: Nvrtc) -> None:
    broken = cuda_decode._SOURCE.replace("const int nb = table_shape[1];", "const int nb = table_shape[1]")
    assert broken != cuda_decode._SOURCE
    result = nvrtc.compile(paged_kernel_source(broken, "bfloat16"))
    assert not result.ok and "error" in result.log


def small_m_qmm_source(*, bits: int, group_size: int, row_tiles: int, split: bool) -> str:
    """`engine.qmm_cuda`'s product wrapped as MLX wraps it, for bf16 rows."""
    t = CUDA_TYPES["bfloat16"]
    out = "float" if split else t
    signature = (f"__global__ void qmm(const {t}* x, const __grid_constant__ Shape x_shape, "
                 "const unsigned* w, const __grid_constant__ Shape w_shape, "
                 f"const {t}* scales, const __grid_constant__ Shape scales_shape, const {t}* biases, "
                 f"{out}* out) {{\n")
    consts = {"BITS": bits, "GS": group_size, "MT": row_tiles, "NPB": qmm_cuda.NPB}
    body = f"  using T = {t};\n" + "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
    source = qmm_cuda._SOURCE.replace("STORE", qmm_cuda._STORE_PART if split else qmm_cuda._STORE_OUT)
    return PRELUDE + qmm_cuda._HEADER + signature + body + source + "\n}\n"


@pytest.mark.parametrize("bits", qmm_cuda.BITS)
@pytest.mark.parametrize("row_tiles", qmm_cuda.ROW_TILES)
@pytest.mark.parametrize("split", [False, True])
def test_the_small_m_quantized_product_compiles_without_spills(nvrtc: Nvrtc, bits: int, row_tiles: int,
                                                                split: bool) -> None:
    result = nvrtc.compile(small_m_qmm_source(bits=bits, group_size=64, row_tiles=row_tiles, split=split))
    assert result.ok, result.log
    assert result.spill_bytes == 0 and result.registers is not None and result.registers <= 255


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("bits", "group_size"), [(8, 64), (4, 64), (8, 32), (4, 128)])
@pytest.mark.parametrize("ring", [False, True])
def test_the_quantized_kv_kernel_compiles_without_spills(nvrtc: Nvrtc, dtype: str, bits: int,
                                                         group_size: int, ring: bool) -> None:
    quant = KVQuant(bits, group_size, 128, getattr(mx, dtype))
    source = cuda_decode._QUANT_RING_SOURCE if ring else cuda_decode._QUANT_SOURCE
    assert source.count("* RW") == 2 and "static_cast<float>(k_pool[" not in source
    result = nvrtc.compile(paged_kernel_source(source, dtype, ring=ring, quant=quant))
    assert result.ok, result.log
    assert result.spill_bytes == 0 and result.registers is not None and result.registers <= 255
