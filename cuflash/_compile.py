"""Turn a kernel config into CUDA source, NVRTC options and a loaded CuPy kernel.

This is the only place that builds kernel source, options and names. Each config gets a tiny
generated `extern "C"` shell that includes the real kernel header from kernels_cu/. CuPy's disk
cache keys on the source string only, not on included headers, so the shell carries a hash of every
file in kernels_cu/: editing a header changes the shell and can never reuse a stale binary.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import os
import pathlib
import re
import tempfile
import threading

from . import families, params
from .families.base import F32, F32_IN, I32_IN, IN, OUT
from .features import Features


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


def kernel_name(tile, features) -> str:
    """cuflash_<family>_<dtype>_<tile tag><variant tag>, e.g. cuflash_fwd_bf16_d128_br128_bc128_w8_s3_drop."""
    return f"cuflash_{families.of(tile).name}_{features.dtype_tag}_{tile.tag()}{features.tag()}"


def _shell(header: str, name: str, launch_bounds: str, pointers: tuple, struct: str, call: str, asserts: str = "",
           args: tuple | None = None) -> str:
    """An extern "C" kernel `name`: the pointers, then the fields of the pass's parameter struct as
    scalar parameters, in the NumPy mirror's order (cuflash/params.py), gathered into a
    cuflash::<struct> that is forwarded to `call` with the pointers.

    Why scalars and not the struct by value (`const __grid_constant__`): with one aggregate kernel
    parameter ptxas keeps the fields in registers for the whole kernel (measured: the v1 d128
    128x128 instance went from 247 registers to 255 and 40-44 B of spills, v2 d64 64x64 dropout
    from 130 to 162); scalar parameters stay constant-bank operands. The device code still sees one
    struct, and the host still builds it once per plan from one definition. `asserts`: more C++
    static_asserts for the shell (the feature set's mirror check)."""
    decls = ", ".join(f"{decl} {n}" for decl, n in pointers)
    names = ", ".join(n for _, n in pointers) if args is None else ", ".join(args)
    fields = params.fields(struct)
    scalars = ", ".join(f"{ctype} {f}_" for f, ctype in fields)
    gather = " ".join(f"p.{f} = {f}_;" for f, _ in fields)
    return (
        f"// cuflash generated shell; kernels_cu sources {source_fingerprint()}\n"
        f'#include "{header}"\n'
        f"{params.static_asserts(struct, fields=False)}"
        f"{asserts}"
        f'extern "C" __global__ void {launch_bounds}{name}({decls}, {scalars}) {{\n'
        f"    cuflash::{struct} p;\n"
        f"    {gather}\n"
        f"    {call}({names}, p);\n"
        f"}}\n"
    )


def kernel_source(tile, features) -> str:
    """The generated extern "C" shell for one (tile, features) instance of the tile's family.

    Every family's template takes <BF16, *tile fields, Variant>: the features' dtype, the tile's
    integer fields in order, and the compile-time feature set (Features.cxx(): dropout, local, ...;
    kernels_cu/attn/features.cuh), whose members the shell checks against the Python fields.
    """
    fam = families.of(tile)
    problem = tile.structural_problem()
    if problem:
        raise ValueError(f"invalid {fam.name} config {tile}: {problem}")
    if tile.head_dim != features.head_dim:
        raise ValueError(f"config {tile} is for head_dim {tile.head_dim}, the problem has {features.head_dim}")
    targs = ", ".join(map(str, tile.template_args()))
    # per-batch key lengths (the KV cache), then variable-length batches: their pointers after the
    # family's, before the params (the kernels' overloads take them in this order)
    # (pointer, whether this instance takes it) for the optional ones, in the templates' order
    optional = ((fam.seqused_k_pointer, features.seqused_k, fam.takes_seqused_k),
                (fam.paged_pointer, features.paged, fam.takes_paged),
                *((ptr, features.varlen, fam.takes_varlen) for ptr in fam.varlen_pointers),
                (fam.alibi_pointer, features.alibi, fam.takes_alibi),
                (fam.mod_pointer, features.user_mod, fam.takes_user_mod),
                *((ptr, features.block_mask, fam.takes_block_mask) for ptr in fam.block_mask_pointers),
                (fam.sinks_pointer, features.sinks, fam.takes_sinks),
                *((ptr, features.split_kv, True) for ptr in fam.split_merge_pointers))
    pointers = fam.pointers + tuple(ptr for ptr, taken, _ in optional if taken)
    # a nullable family's template takes all it has, nullptr for the absent ones
    args = None if not fam.nullable_pointers else (
        *(n for _, n in fam.pointers), *(ptr[1] if taken else "nullptr" for ptr, taken, has in optional if has))
    asserts = features.cxx_asserts()
    if features.user_mod:  # the snippets, as UserModDefs<true> (attn/score_mod.cuh), before the kernel
        if features.mod is None:
            raise ValueError("a user_mod instance needs its snippets (Features.mod)")
        asserts += features.mod.cxx()
    return _shell(fam.header, kernel_name(tile, features), f"{tile.launch_bounds()} ", pointers,
                  fam.params, f"{fam.template}<{features.bf16}, {targs}, {features.cxx()}>", asserts, args)


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', flags=re.M)


def _local_headers(root: pathlib.Path, header: str) -> set:
    """`header` and every local header it includes, transitively, as paths relative to `root`.
    An include resolves against the including file's directory first, then against `root`
    (nvcc's order for quoted includes, with root as the -I directory)."""
    seen, todo = set(), [header]
    while todo:
        rel = todo.pop()
        if rel in seen or not (root / rel).is_file():
            continue
        seen.add(rel)
        here = pathlib.PurePosixPath(rel).parent
        for inc in _INCLUDE.findall((root / rel).read_text("utf-8", "replace")):
            beside = (here / inc).as_posix()
            todo.append(beside if (root / beside).is_file() else inc)
    return seen


_fingerprints: dict = {}


def kernel_fingerprint(family) -> str | None:
    """Hash of what decides a family's binaries: its header and every local header it includes
    (transitively), the template it instantiates, and the NVRTC options. None when the family's
    sources are absent. Editing another family's header does not change it (tuned tables key on it)."""
    if family.name in _fingerprints:
        return _fingerprints[family.name]
    fp = None
    kdir = kernel_dir()
    if (kdir / family.header).is_file():
        row = (family.header, family.template, family.pointers, family.params)
        h = hashlib.sha256(repr(row).encode())
        h.update(repr([o for o in nvrtc_options() if not o.startswith("-I")]).encode())
        for name in sorted(_local_headers(kdir, family.header)):
            h.update(name.encode())
            h.update((kdir / name).read_bytes())
        fp = h.hexdigest()[:16]
    _fingerprints[family.name] = fp
    return fp


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
            log = nvrtc.getProgramLog(prog)
            if "UserModDefs<true>" in source:  # a user snippet's error, with the snippet's lines
                from .score_mods import ModSource, compile_error

                err = compile_error(log, ModSource(score=_snippet(source, "score_mod"), mask=_snippet(source, "mask_mod"),
                                                   grad=_snippet(source, "score_grad")))
                if err is not None:
                    raise err from None
            raise RuntimeError(f"NVRTC failed for {arch}:\n{log}") from e
        log = nvrtc.getProgramLog(prog)
        if "UserModDefs<true>" in source:  # a snippet's instance: checked at run time, then loaded
            _keep_cubin((source, arch), nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    return parse_ptxas_log(log)


# A user snippet's tile is chosen by compiling candidates with ptxas' report (families.select),
# then the chosen one is loaded: without this the first call compiled the same source twice
# (NVRTC, ~0.9 s each at d128). The check's cubin, for the device's own target, is loaded
# instead. A few are kept (a snippet's candidates, the last snippets), not every report's.
_CUBINS_KEPT = 8
_cubins: collections.OrderedDict = collections.OrderedDict()  # (source, arch) -> cubin bytes
_cubins_lock = threading.Lock()


def _keep_cubin(key: tuple, cubin: bytes) -> None:
    with _cubins_lock:
        _cubins[key] = cubin
        _cubins.move_to_end(key)
        while len(_cubins) > _CUBINS_KEPT:
            _cubins.popitem(last=False)


def _kept_cubin(source: str, arch: str) -> bytes | None:
    with _cubins_lock:
        return _cubins.get((source, arch))


def _snippet(source: str, which: str) -> str | None:
    """The snippet a shell carries under `#line 1 "which"` (score_mods.ModSource.cxx), as the body it compiled."""
    m = re.search(rf'#line 1 "{which}"\n(.*?)\n    }}\n', source, flags=re.S)
    return m.group(1) if m else None


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


def _load(source: str, name: str, smem_bytes: int, device_id: int, arch: str | None = None, cubin: bytes | None = None):
    """Compile (CuPy's cache) and load; `arch` (e.g. "sm_90a") when the family needs an
    architecture-specific target: CuPy appends its own -arch=sm_XY after our options, and NVRTC
    still emits the sm_90a binary when ours comes first (checked with NVRTC 13.0 on an H200).
    `cubin`: the binary of this source for this device, already compiled (compile_report's)."""
    import cupy

    options = nvrtc_options() if arch is None else nvrtc_options((f"--gpu-architecture={arch}",))
    with cupy.cuda.Device(device_id):
        if cubin is None:
            fn = cupy.RawModule(code=source, options=options, backend="nvrtc").get_function(name)
        else:  # CuPy loads a binary from a file (its RawKernel: launch and attributes as the others')
            with tempfile.TemporaryDirectory(prefix="cuflash-") as tmp:
                path = os.path.join(tmp, "kernel.cubin")
                with open(path, "wb") as f:
                    f.write(cubin)
                fn = cupy.RawModule(path=path).get_function(name)
                fn.attributes  # loads the module now, while the file exists
        if smem_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem_bytes
    return fn


def get_kernel(tile, features, device_id: int):
    """The loaded kernel for (tile, features) on a device; compiled once per process."""
    key = (tile, features, device_id)  # each family has its own tile class
    fn = _loaded.get(key)
    if fn is None:
        from . import device

        props = device.supported(device_id)  # an older GPU gets cuflash's message, not NVRTC's about cp.async
        fam = families.of(tile)
        target = fam.nvrtc_arch(props)  # the binary's target: a snippet's tile check compiled for it
        arch = target if fam.arch_specific else None  # the others take CuPy's target, as they always did
        source = kernel_source(tile, features)
        cubin = _kept_cubin(source, target) if features.user_mod else None
        try:
            fn = _load(source, kernel_name(tile, features), tile.smem_bytes, device_id, arch, cubin)
        except Exception as e:
            _raise_snippet_error(e, features)
            raise
        _loaded[key] = fn
    return fn


def _raise_snippet_error(e: Exception, features) -> None:
    """A compile failure that a user modification's snippet caused, as its ScoreModError."""
    if getattr(features, "user_mod", False) and features.mod is not None:
        from .score_mods import compile_error

        err = compile_error(str(e), features.mod)
        if err is not None:
            raise err from None


# The small config-free kernels of flash_bwd.cuh (rowwise/): their pointer parameters (named after
# the backward plan's array slots) and parameter struct.
AUX_KERNELS = {
    "bwd_prep": (((IN, "out"), (IN, "dout"), (F32_IN, "lse"), (F32, "delta"), (F32, "lse2"), (F32, "dq_acc")),
                 "BwdParams"),
    "bwd_dq_convert": (((F32_IN, "dq_acc"), (OUT, "dq")), "BwdParams"),
    # the same for a dq_acc in the sm90 backward's fragment order (its dq_bulk 2 tiles)
    "bwd_dq_convert_frag": (((F32_IN, "dq_acc"), (OUT, "dq")), "BwdParams"),
    # GQA/MQA: dK, dV per query head (expanded buffers) summed over each k/v head's group
    "bwd_dkdv_reduce": (((IN, "dk_exp"), (IN, "dv_exp"), (OUT, "dk"), (OUT, "dv")), "BwdParams"),
    # variable-length batches (cuflash/varlen.py): a (row chunks, heads, batch) grid over the sequences
    "bwd_prep_varlen": (((IN, "out"), (IN, "dout"), (F32_IN, "lse"), (F32, "delta"), (F32, "lse2"), (F32, "dq_acc"),
                         (I32_IN, "cu_seqlens_q")), "BwdParams"),
    "bwd_dq_convert_varlen": (((F32_IN, "dq_acc"), (OUT, "dq"), (I32_IN, "cu_seqlens_q")), "BwdParams"),
    "bwd_dq_convert_frag_varlen": (((F32_IN, "dq_acc"), (OUT, "dq"), (I32_IN, "cu_seqlens_q")), "BwdParams"),
}


def aux_source(name: str, dtype: str, head_dim: int) -> tuple[str, str]:
    """Shell for a small config-free kernel of flash_bwd.cuh (`bwd_prep`, `bwd_dq_convert`,
    `bwd_dkdv_reduce`; rowwise/)."""
    f = Features(dtype, head_dim)
    fn = f"cuflash_{name}_{f.dtype_tag}_d{head_dim}"
    pointers, struct = AUX_KERNELS[name]
    return _shell("flash_bwd.cuh", fn, "", pointers, struct, f"cuflash::{name}<{f.bf16}, {head_dim}>"), fn


def get_aux_kernel(name: str, features, device_id: int):
    key = ("aux", name, features.dtype, features.head_dim, device_id)
    fn = _loaded.get(key)
    if fn is None:
        from . import device

        device.supported(device_id)
        src, fname = aux_source(name, features.dtype, features.head_dim)
        fn = _loaded[key] = _load(src, fname, 0, device_id)
    return fn
