"""Golden compile figures for the restructuring guard (issue 9): per selectable kernel instance and
architecture, ptxas' registers / spills / stack and a hash of the SASS of the kernel's .text section.

    python scripts/golden/compile_golden.py record tests/golden/compile.json
    python scripts/golden/compile_golden.py check  tests/golden/compile.json

Runs on CPU (NVRTC). The SASS hash is the strongest CPU-side guard for a pure code move: equal
machine code means bitwise-equal outputs. Where the code legitimately changes (a parameter struct
changes the constant-bank loads), `check` falls back to the register/spill rule and says so; the
GPU golden outputs (outputs_golden.py) then decide.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import struct
import sys
from concurrent.futures import ProcessPoolExecutor

# This checkout's cuflash, not whatever `import cuflash` finds first (an editable install of
# another worktree would silently be measured instead).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

ARCHS = ("sm_80", "sm_90a")
DTYPES = ("bfloat16", "float16")


def instances():
    """[(label, source, kernel name)] for every instance the package may select without tuning."""
    from cuflash import _compile, families
    from cuflash.features import Features

    out = []
    cfgs = (families.FWD.selectable() + sorted(families.BWD.selectable() + families.BWD_DQ.selectable(),
                                               key=lambda c: (families.of(c).name, c))
            + families.FWD_V1.selectable())
    for cfg in cfgs:
        for dtype in DTYPES:
            for drop in (False, True):
                label = (f"{families.of(cfg).name}/{dtype}/d{cfg.head_dim}_q{cfg.block_q}_k{cfg.block_k}_w{cfg.warps}"
                         f"_s{cfg.stages}/{'drop' if drop else 'plain'}")
                out.append((label, _compile.kernel_source(cfg, Features(dtype, cfg.head_dim, drop)), _compile.kernel_name(cfg, Features(dtype, cfg.head_dim, drop))))
    for name in ("bwd_prep", "bwd_dq_convert"):
        for dtype in DTYPES:
            for d in (64, 128):
                src, fn = _compile.aux_source(name, dtype, d)
                out.append((f"{name}/{dtype}/d{d}", src, fn))
    return out


def _sections(elf: bytes) -> dict:
    """name -> bytes of every section of a 64-bit little-endian ELF (a cubin)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    stroff = hdrs[shstrndx][4]

    def name(off):
        end = elf.index(b"\0", stroff + off)
        return elf[stroff + off:end].decode()

    return {name(h[0]): elf[h[4]:h[4] + h[5]] for h in hdrs if h[1] != 8}  # 8 = SHT_NOBITS


def compile_one(args):
    label, source, kname, arch = args
    from cupy_backends.cuda.libs import nvrtc

    from cuflash import _compile

    prog = nvrtc.createProgram(source, "cuflash_shell.cu", [], [])
    try:
        opts = list(_compile.nvrtc_options((f"--gpu-architecture={arch}", "-Xptxas", "-v")))
        nvrtc.compileProgram(prog, opts)
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    rep = _compile.parse_ptxas_log(log)
    secs = _sections(cubin)
    text = secs.get(f".text.{kname}", b"")
    return f"{label}/{arch}", {
        "registers": rep["registers"], "spill_stores": rep["spill_stores"], "spill_loads": rep["spill_loads"],
        "stack_bytes": rep["stack_bytes"], "smem_static_bytes": rep["smem_static_bytes"],
        "sass_bytes": len(text), "sass_sha": hashlib.sha256(text).hexdigest()[:16],
    }


def run_all(jobs: int = 2) -> dict:
    work = [(lab, src, kn, arch) for lab, src, kn in instances() for arch in ARCHS]
    with ProcessPoolExecutor(jobs) as ex:
        return dict(sorted(ex.map(compile_one, work)))


def check(golden: dict, now: dict, reg_tol: int = 4) -> list[str]:
    """Problems (empty when the guard holds) and a summary line of how many are SASS-identical."""
    problems, same = [], 0
    for key, g in golden.items():
        n = now.get(key)
        if n is None:
            problems.append(f"{key}: missing now")
            continue
        if n["sass_sha"] == g["sass_sha"]:
            same += 1
            continue
        if n["spill_stores"] > g["spill_stores"] or n["spill_loads"] > g["spill_loads"] or n["stack_bytes"] > g["stack_bytes"]:
            problems.append(f"{key}: spills/stack {g['spill_stores']}/{g['stack_bytes']} -> {n['spill_stores']}/{n['stack_bytes']}")
        if abs(n["registers"] - g["registers"]) > reg_tol:
            problems.append(f"{key}: registers {g['registers']} -> {n['registers']}")
    print(f"{same}/{len(golden)} instances SASS-identical to the golden set; the rest checked by registers/spills")
    return problems


def main(argv):
    mode, path = argv[1], argv[2]
    jobs = int(argv[3]) if len(argv) > 3 else 2
    now = run_all(jobs)
    if mode == "record":
        with open(path, "w") as f:
            json.dump(now, f, indent=1, sort_keys=True)
        print(f"recorded {len(now)} instances to {path}")
        return 0
    with open(path) as f:
        golden = json.load(f)
    problems = check(golden, now)
    for p in problems:
        print("GUARD:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
