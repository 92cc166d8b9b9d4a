"""Compile our CUDA kernels with NVRTC on a machine without a GPU: errors, registers, loads.

    python -m bench.kernel_compile

MLX compiles a `mx.fast.cuda_kernel` with NVRTC the first time it runs, so a mistake in a
kernel's source only shows on a GPU. The `nvidia-cuda-nvrtc-cu12` and
`nvidia-cuda-runtime-cu12` wheels (the `kernels` extra; Linux only) compile the same
source here. The wrapper below copies the one MLX writes
(`mlx/backend/cuda/custom_kernel.cpp`, `build_kernel`): inputs as `const T*`, a `Shape`
for each input whose `<name>_shape` the source uses, outputs, then the template
arguments as `constexpr int` / `using` lines. MLX's own device header is not available
here, so `Shape` is a stand-in with the same indexing.

For each kernel, dtype and unroll it prints ptxas's registers and spills for sm_90, and it
counts the PTX's global loads, shuffles and exponentials. Session 8 used these figures to
read the paged kernel's sweep (`bench.kernel_sweep`, docs/throughput.md). It also compiles
`bench.kernel_merge`'s lanes merge, and exits 1 if any source fails to compile.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.kv import cuda_decode

CUDA_TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}
PRELUDE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct Shape { int data[8]; __device__ int operator[](int i) const { return data[i]; } };
"""
PTX_OPS = r"\b(ld\.global(?:\.nc)?(?:\.v\d)?\.[a-z0-9]+|shfl\.sync\.[a-z]+\.b32|ex2\.approx\.[a-z0-9.]+)"


@dataclass(frozen=True)
class Compiled:
    ok: bool
    log: str
    registers: int | None
    spill_bytes: int | None


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
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
                        warps: int = cuda_decode.WARPS) -> str:
    """`source` (the body `cuda_decode` hands MLX) wrapped as MLX wraps it."""
    t = CUDA_TYPES[dtype]
    signature = (f"__global__ void paged(const {t}* q, const {t}* k_pool, const {t}* v_pool, "
                 "const int* table, const __grid_constant__ Shape table_shape, const int* lengths, "
                 "const float* scale, const int* part, float* out, float* out_m, float* out_l) {\n")
    consts = {"D": head_dim, "H": kv_heads, "REP": rep, "BS": block_size, "WARPS": warps,
              "U": unroll}
    body = f"  using T = {t};\n" + "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
    return PRELUDE + cuda_decode._HEADER + signature + body + source + "\n}\n"


def merge_kernel_source(dtype: str, head_dim: int = 128, source: str = cuda_decode._MERGE_SOURCE,
                        **constants: int) -> str:
    """A partitions' merge (the engine's, or `source` with its `constants`, such as
    `bench.kernel_merge`'s LANES) wrapped as MLX wraps it."""
    t = CUDA_TYPES[dtype]
    signature = ("__global__ void merge(const float* part_out, const float* m, "
                 f"const __grid_constant__ Shape m_shape, const float* l, {t}* y) {{\n")
    consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in {"D": head_dim, **constants}.items())
    return PRELUDE + cuda_decode._HEADER + signature + f"  using T = {t};\n" + consts + source + "\n}\n"


class Nvrtc:
    def __init__(self, library: Path, include: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.include = include

    def _run(self, code: str, options: list[str]) -> tuple[int, str, ctypes.c_void_p]:
        prog = ctypes.c_void_p()
        if self.lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"kernel.cu", 0, None, None) != 0:
            raise RuntimeError("nvrtcCreateProgram failed")
        opts = [o.encode() for o in (*options, "-std=c++17", "-diag-suppress=177", f"-I{self.include}")]
        rc = self.lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, log)
        return rc, log.value.decode(errors="replace"), prog

    def compile(self, code: str) -> Compiled:
        """Compiled for sm_90 (the H200), with ptxas's resource report."""
        rc, log, prog = self._run(code, ["--gpu-architecture=sm_90", "--ptxas-options=-v"])
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        regs = re.search(r"Used (\d+) registers", log)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        return Compiled(rc == 0, log, int(regs.group(1)) if regs else None,
                        sum(int(s) for s in spills) if spills else None)

    def ptx_ops(self, code: str) -> dict[str, int]:
        """Global loads, shuffles and exponentials in the PTX, by instruction (static counts)."""
        rc, log, prog = self._run(code, ["--gpu-architecture=compute_90"])
        if rc != 0:
            raise RuntimeError(log)
        size = ctypes.c_size_t()
        self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetPTX(prog, buf)
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return dict(collections.Counter(re.findall(PTX_OPS, buf.value.decode())))


def main() -> int:
    paths = nvrtc_paths()
    if paths is None:
        print("needs the nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 wheels: "
              "pip install -e '.[kernels]'")
        return 2
    from bench import kernel_merge, kernel_sweep

    nvrtc = Nvrtc(*paths)
    failed = 0
    for dtype in CUDA_TYPES:
        result = nvrtc.compile(merge_kernel_source(dtype))
        failed += not result.ok
        print(f"merge {dtype}: ok={result.ok} registers={result.registers}")
        for lanes in (1, kernel_merge.MAX_LANES):
            result = nvrtc.compile(merge_kernel_source(dtype, source=kernel_merge._SOURCE, LANES=lanes))
            failed += not result.ok
            print(f"lanes merge {dtype} LANES={lanes}: ok={result.ok} registers={result.registers}")
            if not result.ok:
                print(result.log)
    cases = (("bfloat16", 1), ("bfloat16", 4), ("bfloat16", 8), ("float16", 4), ("float32", 4))
    for kind, (_, build, _fits) in kernel_sweep.SOURCES.items():
        for dtype, unroll in cases:
            code = paged_kernel_source(build(), dtype, unroll=unroll, warps=kernel_sweep.launch_of(kind)[1])
            result = nvrtc.compile(code)
            failed += not result.ok
            ops = nvrtc.ptx_ops(code) if result.ok else {}
            print(f"{kind} {dtype} U={unroll}: ok={result.ok} registers={result.registers} "
                  f"spills={result.spill_bytes} {ops}")
            if not result.ok:
                print(result.log)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
