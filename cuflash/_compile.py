"""Turn a kernel config into CUDA source, NVRTC options and a loaded CuPy kernel.

This is the only place that builds kernel source, options and names. Each config gets a tiny
generated `extern "C"` shell that includes the real kernel header from kernels_cu/. CuPy's disk
cache keys on the source string only, not on included headers, so the shell carries a hash of every
file in kernels_cu/: editing a header changes the shell and can never reuse a stale binary.
"""
from __future__ import annotations

import functools
import hashlib
import pathlib
import re


_DTYPE_TAG = {"float16": ("f16", "false"), "bfloat16": ("bf16", "true")}


@functools.lru_cache(maxsize=None)
def kernel_dir() -> pathlib.Path:
    """kernels_cu/ as installed (cuflash/kernels_cu in the wheel) or beside the package in a checkout.

    Looked up by path, not importlib.resources: kernels_cu has no __init__.py, and for such a
    namespace package files() returns a MultiplexedPath whose str() is not a path.
    """
    here = pathlib.Path(__file__).resolve().parent
    for d in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (d / "common.cuh").is_file():
            return d
    raise FileNotFoundError(f"cuflash kernel sources not found (looked in {here / 'kernels_cu'} and "
                            f"{here.parent / 'kernels_cu'})")


@functools.lru_cache(maxsize=None)
def source_fingerprint() -> str:
    h = hashlib.sha256()
    root = kernel_dir()
    for rel in sorted(p.relative_to(root).as_posix() for p in root.rglob("*.cu*")):
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:16]


# kernel -> (header, device template, parameter macro, argument macro). Every kernel template takes
# <BF16, D, BR, BC, WARPS, STAGES, DROPOUT>; the config's KERNEL names its row here. DROPOUT is not a
# tuning choice but a variant: the kernels with fused dropout are separate instantiations, so the
# plain ones carry no Philox code (nor its registers).
_KERNELS = {
    "fwd": ("flash_fwd.cuh", "cuflash::flash_fwd", "CUFLASH_FWD_PARAMS", "CUFLASH_FWD_ARGS"),
    "bwd": ("flash_bwd.cuh", "cuflash::flash_bwd_dkdv", "CUFLASH_BWD_PARAMS", "CUFLASH_BWD_ARGS"),
    "bwd_dq": ("flash_bwd.cuh", "cuflash::flash_bwd_dq", "CUFLASH_DQ_PARAMS", "CUFLASH_DQ_ARGS"),
    "fwd_v1": ("flash_fwd_v1.cuh", "cuflash::flash_fwd_v1", "CUFLASH_FWDV1_PARAMS", "CUFLASH_FWDV1_ARGS"),
}


def kernel_name(cfg, dtype: str, dropout: bool = False) -> str:
    tag = _DTYPE_TAG[dtype][0]
    return (f"cuflash_{cfg.KERNEL}_{tag}_d{cfg.head_dim}_br{cfg.block_q}_bc{cfg.block_k}"
            f"_w{cfg.warps}_s{cfg.stages}" + ("_drop" if dropout else ""))


def kernel_source(cfg, dtype: str, dropout: bool = False) -> str:
    """The generated extern "C" shell for one config of any kernel in _KERNELS."""
    problem = cfg.structural_problem()
    if problem:
        raise ValueError(f"invalid {cfg.KERNEL} config {cfg}: {problem}")
    header, template, params, args = _KERNELS[cfg.KERNEL]
    bf16 = _DTYPE_TAG[dtype][1]
    return (
        f"// cuflash generated shell; kernels_cu sources {source_fingerprint()}\n"
        f'#include "{header}"\n'
        f'extern "C" __global__ void __launch_bounds__({cfg.threads}) {kernel_name(cfg, dtype, dropout)}({params}) {{\n'
        f"    {template}<{bf16}, {cfg.head_dim}, {cfg.block_q}, {cfg.block_k}, "
        f"{cfg.warps}, {cfg.stages}, {'true' if dropout else 'false'}>({args});\n"
        f"}}\n"
    )


# The forward's names, kept for the tests and scripts written against them.
fwd_kernel_name = kernel_name
fwd_source = kernel_source


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


def _load(source: str, name: str, smem_bytes: int, device_id: int):
    import cupy

    with cupy.cuda.Device(device_id):
        mod = cupy.RawModule(code=source, options=nvrtc_options(), backend="nvrtc")
        fn = mod.get_function(name)
        if smem_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem_bytes
    return fn


def get_kernel(cfg, dtype: str, device_id: int, dropout: bool = False):
    """The loaded kernel for (config, dtype, dropout variant) on a device; compiled once per process."""
    key = (cfg.KERNEL, cfg, dtype, device_id) if not dropout else (cfg.KERNEL, cfg, dtype, device_id, "drop")
    fn = _loaded.get(key)
    if fn is None:
        fn = _loaded[key] = _load(kernel_source(cfg, dtype, dropout), kernel_name(cfg, dtype, dropout),
                                  cfg.smem_bytes, device_id)
    return fn


get_fwd_kernel = get_kernel


def aux_source(name: str, dtype: str, head_dim: int) -> tuple[str, str]:
    """Shell for a small config-free kernel of flash_bwd.cuh (`bwd_prep`, `bwd_dq_convert`; aux/)."""
    tag, bf16 = _DTYPE_TAG[dtype]
    fn = f"cuflash_{name}_{tag}_d{head_dim}"
    params = {"bwd_prep": "CUFLASH_PREP_PARAMS", "bwd_dq_convert": "CUFLASH_CONVERT_PARAMS"}[name]
    return (
        f"// cuflash generated shell; kernels_cu sources {source_fingerprint()}\n"
        f'#include "flash_bwd.cuh"\n'
        f'extern "C" __global__ void {fn}({params}) {{\n'
        f"    cuflash::{name}<{bf16}, {head_dim}>({params.replace('PARAMS', 'ARGS')});\n"
        f"}}\n"
    ), fn


def get_aux_kernel(name: str, dtype: str, head_dim: int, device_id: int):
    key = ("aux", name, dtype, head_dim, device_id)
    fn = _loaded.get(key)
    if fn is None:
        src, fname = aux_source(name, dtype, head_dim)
        fn = _loaded[key] = _load(src, fname, 0, device_id)
    return fn
