"""Where the Hopper deterministic backward waits, against the atomic one (issue 11's last bar): per
CTA of one launch of the sm90 dK/dV kernel, the nanoseconds (%globaltimer) its dQ store warp spends
waiting for its turns, for the consumers' staged blocks and for its reductions to complete, and
its dQ consumers' wait for the store warp to free the staging; the same tile with dq_bulk 4 (the
atomic mode: no turns, no completion waits) and 3 (the deterministic mode), one call each.

    python scripts/trace_det_waits.py [--shapes 64:2048,128:2048] [--causal] [--json F] [--check]

--check (no GPU): patch a copy of kernels_cu/ and compile both tiles' traced kernels for sm_90a.

Per CTA (slots of the trace buffer, each a sum over the CTA's steps unless said):
  0 start (thread 0)            1 end: the last consumer's epilogue or the store warp's last completion (max)
  2 turn waits (store warp lane 0: from the first acquire load until it saw the turn; one round trip when the turn was there)
  3 DqFull waits (the store warp idle until a consumer's block is staged)
  (2-4 summed over the deterministic mode's store warps: one per dQ consumer and staging set)
  4 completion waits (bulk_wait0 before passing the turns; deterministic only)
  5 DqEmpty waits (the dQ consumers, each warpgroup's first thread: until the store warp has read the last block)
  6 turn waits that spun (the turn was not there at the first load)   7 the SM id
The patch adds global reductions per step (red.add of a few ns counts), so both modes pay the same
small perturbation. Printed per mode: medians over CTAs, and each wait's share of the CTAs' time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from trace_bwd_tiles import load_traced, stats  # noqa: E402  (the sibling script's compile-and-cache helpers)

from cuflash import _compile  # noqa: E402
from cuflash.features import Features  # noqa: E402
from cuflash.tiles import Sm90BwdConfig  # noqa: E402

_HELPERS = (
    "\n__device__ unsigned long long cuflash_bwd_trace[65536 * 8];\n"
    "__device__ __forceinline__ unsigned long long trace_now() {\n"
    "    unsigned long long t; asm volatile(\"mov.u64 %0, %globaltimer;\" : \"=l\"(t)); return t; }\n"
    "__device__ __forceinline__ unsigned trace_smid() {\n"
    "    unsigned s; asm volatile(\"mov.u32 %0, %smid;\" : \"=r\"(s)); return s; }\n"
    "#define TRACE_AT(slot) (::cuflash_bwd_trace[(long long)blockIdx.x * 8 + (slot)])\n"
    "#define TRACE_ADD(slot, v) atomicAdd(&TRACE_AT(slot), (unsigned long long)(v))\n"
    "#define TRACE_MAX(slot, v) atomicMax(&TRACE_AT(slot), (unsigned long long)(v))\n")

# (anchor, replacement): each anchor must occur exactly once in sm90/bwd.cuh
_PATCHES = [
    ("#include \"sm90/bwd_traits.cuh\"\n", "#include \"sm90/bwd_traits.cuh\"\n" + _HELPERS),
    ("    const int tid = threadIdx.x;\n",
     "    const int tid = threadIdx.x;\n"
     "    if (tid == 0) { TRACE_AT(0) = ::trace_now(); TRACE_AT(7) = ::trace_smid(); }\n"),
    # the atomic mode's store warp (fragment order): the DqFull wait
    ("                            named_bar_sync(Tr::kBarDqFull + c, Tr::kDqBarThreads);\n"
     "                            if (lane == 0) {\n"
     "                                bulk_reduce_add_f32(",
     "                            { const unsigned long long tf = ::trace_now();\n"
     "                              named_bar_sync(Tr::kBarDqFull + c, Tr::kDqBarThreads);\n"
     "                              if (lane == 0) TRACE_ADD(3, ::trace_now() - tf); }\n"
     "                            if (lane == 0) {\n"
     "                                bulk_reduce_add_f32("),
    # the deterministic mode's store warps: the DqFull wait, then the turn wait
    ("                    named_bar_sync(Tr::bar_dq_full(set, c), Tr::kDqBarThreads);\n"
     "                    if (lane == 0) {\n"
     "                        while (ld_acquire_gpu(sem) != rank) __nanosleep(32);\n",
     "                    { const unsigned long long tf = ::trace_now();\n"
     "                      named_bar_sync(Tr::bar_dq_full(set, c), Tr::kDqBarThreads);\n"
     "                      if (lane == 0) TRACE_ADD(3, ::trace_now() - tf); }\n"
     "                    if (lane == 0) {\n"
     "                        const unsigned long long tt = ::trace_now(); bool spun = false;\n"
     "                        while (ld_acquire_gpu(sem) != rank) { spun = true; __nanosleep(32); }\n"
     "                        TRACE_ADD(2, ::trace_now() - tt); if (spun) TRACE_ADD(6, 1);\n"),
    ("                        bulk_wait0();                // the reduction is done in global memory, not only read\n",
     "                        { const unsigned long long tc = ::trace_now(); bulk_wait0();\n"
     "                          const unsigned long long te = ::trace_now(); TRACE_ADD(4, te - tc); TRACE_MAX(1, te); }\n"),
    # the dQ consumers (fragment order): the DqEmpty wait, either mode
    ("                        named_bar_sync(Tr::bar_dq_empty(set, cw), Tr::kDqBarThreads);  // its store warp has read the set's last block\n",
     "                        { const unsigned long long te = ::trace_now();\n"
     "                          named_bar_sync(Tr::bar_dq_empty(set, cw), Tr::kDqBarThreads);\n"
     "                          if (ctid == 0) TRACE_ADD(5, ::trace_now() - te); }\n"),
    ("                        named_bar_sync(Tr::kBarDqEmpty + cw, Tr::kDqBarThreads);  // the store warp has read the last block\n",
     "                        { const unsigned long long te = ::trace_now();\n"
     "                          named_bar_sync(Tr::kBarDqEmpty + cw, Tr::kDqBarThreads);\n"
     "                          if (ctid == 0) TRACE_ADD(5, ::trace_now() - te); }\n"),
]
# after the consumers' dK/dV stores (the CTA's end for the atomic mode)
_END_ANCHOR = ("                if (v_col) *reinterpret_cast<uint4*>(dvg + (long long)row * params.dv_sn) = b;\n"
               "            }\n        }\n")


def patched_kernel_dir(tmp: pathlib.Path) -> pathlib.Path:
    dst = tmp / "kernels_cu"
    shutil.copytree(_compile.kernel_dir(), dst)
    p = dst / "sm90" / "bwd.cuh"
    s = p.read_text()
    for anchor, text in _PATCHES + [(_END_ANCHOR, _END_ANCHOR + "        if (tid % 128 == 0) TRACE_MAX(1, ::trace_now());\n")]:
        assert s.count(anchor) == 1, f"anchor not found once in sm90/bwd.cuh (the kernel changed?): {anchor[:80]!r}"
        s = s.replace(anchor, text)
    p.write_text(s)
    return dst


def tiles_of(d: int, spec: str) -> dict:
    fields = [int(x) for x in spec.split(",")]
    atomic = Sm90BwdConfig(d, *fields[1:])
    return {"atomic": dataclasses.replace(atomic, dq_bulk=4), "deterministic": dataclasses.replace(atomic, dq_bulk=3)}


def check(kdir: pathlib.Path, shapes, spec):
    """Compile every traced kernel for sm_90a with NVRTC (no GPU): the patches apply and build."""
    from cupy_backends.cuda.libs import nvrtc

    for d, _ in shapes:
        for mode, tile in tiles_of(d, spec).items():
            src = _compile.kernel_source(tile, Features("bfloat16", d))
            prog = nvrtc.createProgram(src, "traced.cu", [], [])
            opts = ["--std=c++17", "--use_fast_math", f"-I{kdir}", "--gpu-architecture=sm_90a", "-Xptxas", "-v"]
            try:
                nvrtc.compileProgram(prog, opts)
            except nvrtc.NVRTCError:
                raise SystemExit(f"d{d} {mode} {tile.label()}: compile failed\n{nvrtc.getProgramLog(prog)[-3000:]}")
            log = nvrtc.getProgramLog(prog)
            regs = [ln.strip() for ln in log.splitlines() if "registers" in ln or "spill" in ln]
            print(f"d{d} {mode:13s} {tile.label()}: compiled; " + " | ".join(regs[-2:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="64:2048,128:2048", help="head_dim:seqlen pairs (16k tokens, 2048 / d heads)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tile", default="64,64,2,2,4,1", help="Sm90BwdConfig fields (head dim replaced per shape; dq_bulk per mode)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--check", action="store_true", help="compile the traced kernels only (no GPU)")
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(":")) for s in a.shapes.split(",")]
    kdir = patched_kernel_dir(pathlib.Path(tempfile.mkdtemp(prefix="cuflash-det-trace-")))
    if a.check:
        check(kdir, shapes, a.tile)
        return

    import cupy

    import cuflash
    from cuflash import _backward, testing

    rows = []
    for d, n in shapes:
        h, b = 2048 // d, max(1, 16384 // n)
        rng = np.random.default_rng(0)
        q, k, v = testing.random_qkv(rng, b, n, n, h, d, testing.bf16())
        dout = testing.random_qkv(rng, b, n, n, h, d, testing.bf16())[0]
        out, lse = cuflash.attention(q, k, v, causal=a.causal, return_lse=True)
        tiles = tiles_of(d, a.tile)
        for mode, tile in tiles.items():
            mod = load_traced(tile, Features("bfloat16", d), kdir)

            def call(tile=tiles["atomic"], det=mode == "deterministic"):
                # deterministic=True runs the given tile with dq_bulk 3 (_backward._build_plan)
                return _backward.backward(dout, q, k, v, out, lse, causal=a.causal, config=tile, deterministic=det)
            for _ in range(5):
                call()
            buf = cupy.ndarray((65536 * 8,), cupy.uint64, mod.get_global("cuflash_bwd_trace"))
            buf.fill(0)
            cupy.cuda.Device().synchronize()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            call()
            end.record()
            end.synchronize()
            ms = cupy.cuda.get_elapsed_time(start, end)
            n_cta = -(-n // tile.block_k) * h * b
            t = buf[: n_cta * 8].get().reshape(n_cta, 8).astype(np.int64)
            if not t[:, 0].any():
                raise SystemExit(f"{mode}: no stamps (the call did not run the traced kernel)")
            dur = t[:, 1] - t[:, 0]
            total = float(dur.sum())
            waits = {"turn": t[:, 2], "dq_full (store warp idle)": t[:, 3], "completion": t[:, 4],
                     "dq_empty (consumers)": t[:, 5]}
            row = {"head_dim": d, "seqlen": n, "causal": a.causal, "mode": mode, "tile": tile.label(), "ctas": n_cta,
                   "call_ms": ms, "span_us": float(t[:, 1].max() - t[:, 0].min()) / 1e3, "cta_ns": stats(dur),
                   "waits_ns": {k2: stats(v2) for k2, v2 in waits.items()},
                   "wait_share": {k2: float(v2.sum()) / total for k2, v2 in waits.items()},
                   "spun_turns_per_cta": stats(t[:, 6]), "ctas_per_sm": stats(np.bincount(t[:, 7]))}
            rows.append(row)
            print(f"d{d} N{n} {'causal' if a.causal else 'dense'} {mode} {tile.label()}: call {ms:.3f} ms, "
                  f"span {row['span_us']:.1f} us, CTA median {row['cta_ns']['median']:.0f} ns")
            for k2, v2 in row["waits_ns"].items():
                print(f"   {k2:26s} median {v2['median']:8.0f} ns  p90 {v2['p90']:8.0f}  share {row['wait_share'][k2]:.3f}")
            print(f"   turns that spun per CTA: median {row['spun_turns_per_cta']['median']:.0f}, "
                  f"p90 {row['spun_turns_per_cta']['p90']:.0f}")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
