"""Turn a kernel config into CUDA source, NVRTC options and a loaded CuPy kernel.

This is the only place that builds kernel source, options and names. Each config gets a tiny
generated `extern "C"` shell that includes the real kernel header from kernels_cu/. CuPy's disk
cache keys on the source string only, not on included headers, so the shell carries a hash of every
file in kernels_cu/: editing a header changes the shell and can never reuse a stale binary.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.resources
import pathlib
import re

from ._configs import FwdConfig

_DTYPE_TAG = {"float16": ("f16", "false"), "bfloat16": ("bf16", "true")}


@functools.lru_cache(maxsize=None)
def kernel_dir() -> pathlib.Path:
    """kernels_cu/ as installed (cuflash/kernels_cu in the wheel) or beside the package in a checkout."""
    try:
        d = pathlib.Path(str(importlib.resources.files("cuflash.kernels_cu")))
        if (d / "common.cuh").is_file():
            return d
    except ModuleNotFoundError:
        pass
    d = pathlib.Path(__file__).resolve().parent.parent / "kernels_cu"
    if not (d / "common.cuh").is_file():
        raise FileNotFoundError(f"cuflash kernel sources not found (looked in the package and in {d})")
    return d


@functools.lru_cache(maxsize=None)
def source_fingerprint() -> str:
    h = hashlib.sha256()
    for p in sorted(kernel_dir().glob("*.cu*")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def fwd_kernel_name(cfg: FwdConfig, dtype: str) -> str:
    tag = _DTYPE_TAG[dtype][0]
    return (f"cuflash_fwd_{tag}_d{cfg.head_dim}_br{cfg.block_q}_bc{cfg.block_k}"
            f"_w{cfg.warps}_s{cfg.stages}")


def fwd_source(cfg: FwdConfig, dtype: str) -> str:
    problem = cfg.structural_problem()
    if problem:
        raise ValueError(f"invalid forward config {cfg}: {problem}")
    bf16 = _DTYPE_TAG[dtype][1]
    name = fwd_kernel_name(cfg, dtype)
    return (
        f"// cuflash generated shell; kernels_cu sources {source_fingerprint()}\n"
        f'#include "flash_fwd.cuh"\n'
        f'extern "C" __global__ void __launch_bounds__({cfg.threads}) {name}(CUFLASH_FWD_PARAMS) {{\n'
        f"    cuflash::flash_fwd<{bf16}, {cfg.head_dim}, {cfg.block_q}, {cfg.block_k}, "
        f"{cfg.warps}, {cfg.stages}>(CUFLASH_FWD_ARGS);\n"
        f"}}\n"
    )


def nvrtc_options(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return ("--std=c++17", "--use_fast_math", f"-I{kernel_dir()}") + tuple(extra)


# ----------------------------------------------------------------------------- offline compile
@functools.lru_cache(maxsize=None)
def compile_report(source: str, arch: str) -> dict:
    """Compile with NVRTC for `arch` (e.g. "sm_80", "sm_90a") without a GPU; return ptxas' resource use.

    Keys: registers, spill_stores, spill_loads, stack_bytes, smem_static_bytes, log.
    """
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "cuflash_shell.cu", [], [])
    try:
        opts = list(nvrtc_options((f"--gpu-architecture={arch}", "-Xptxas", "-v")))
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {arch}:\n{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return parse_ptxas_log(log)


def parse_ptxas_log(log: str) -> dict:
    def grab(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack_bytes": grab(r"(\d+) bytes stack frame"),
        "smem_static_bytes": grab(r"(\d+) bytes smem"),
        "log": log,
    }


# ----------------------------------------------------------------------------- runtime load
_loaded: dict = {}


def get_fwd_kernel(cfg: FwdConfig, dtype: str, device_id: int):
    """The loaded kernel for (config, dtype) on a device; compiled once per process and device."""
    key = (cfg, dtype, device_id)
    fn = _loaded.get(key)
    if fn is None:
        import cupy

        with cupy.cuda.Device(device_id):
            mod = cupy.RawModule(code=fwd_source(cfg, dtype), options=nvrtc_options(), backend="nvrtc")
            fn = mod.get_function(fwd_kernel_name(cfg, dtype))
            if cfg.smem_bytes > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = cfg.smem_bytes
        _loaded[key] = fn
    return fn
