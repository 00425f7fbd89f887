"""Where the Hopper forward's time goes, work tile by work tile: %globaltimer stamps (ns) at the phase
boundaries of each consumer warpgroup's tiles, on the lent GPU (issue 10's short cells).

    python scripts/trace_fwd_tiles.py [--shapes 128:512,128:8192] [--causal] [--json F]

The automatic forward (its tuned tile) runs from a patched copy of kernels_cu/ (sm90/fwd.cuh with
trace stores behind anchors of its text; main's sources are untouched): the kernel-source
fingerprints are computed first, so the tuned table still applies, then _compile.kernel_dir points
at the copy. Per work tile and consumer c (slots 4 c ..): 0 the tile received, 1 its Q landed, 2 the
epilogue begins, 3 the epilogue's stores are issued. Printed: each phase's median / p10 / p90 over
tiles (consumer 0 and 1), and the share of the kernel's span the epilogues take."""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile

import cupy
import numpy as np

import cuflash
from cuflash import _compile, families, testing

_DECL = ("\n__device__ unsigned long long cuflash_fwd_trace[262144 * 8];\n"
         "__device__ __forceinline__ unsigned long long trace_now() {\n"
         "    unsigned long long t; asm volatile(\"mov.u64 %0, %globaltimer;\" : \"=l\"(t)); return t; }\n"
         "#define TRACE(tile, slot) (::cuflash_fwd_trace[(long long)(tile) * 8 + (slot)] = ::trace_now())\n")
_PATCHES = [
    ("#include \"sm90/traits.cuh\"\n", _DECL),
    ("\n            const Tile w(tile, geo, m_blocks, n_heads, n_tiles, seqs);\n",
     "            if (ctid == 0 && cw < 2) TRACE(tile, 4 * cw + 0);\n"),
    ("                mbar_wait(bars.q_full(qs), (local / QSTAGES) & 1);\n",
     "                if (ctid == 0 && cw < 2) TRACE(tile, 4 * cw + 1);\n"),
    ("            // ---------------- epilogue: O = O~ / l (x 1/(1-p) with dropout), lse ----------------\n",
     "            if (ctid == 0 && cw < 2) TRACE(tile, 4 * cw + 2);\n"),
    (("                        *reinterpret_cast<u32*>(orow + 8 * nt) = pack2<BF16>(x0, x1);\n"
      "                    }\n                }\n            }\n"),
     "            if (ctid == 0 && cw < 2) TRACE(tile, 4 * cw + 3);\n"),
]


def patched_kernel_dir(tmp: pathlib.Path) -> pathlib.Path:
    dst = tmp / "kernels_cu"
    shutil.copytree(_compile.kernel_dir(), dst)
    p = dst / "sm90" / "fwd.cuh"
    s = p.read_text()
    for anchor, text in _PATCHES:
        assert s.count(anchor) == 1, anchor
        s = s.replace(anchor, anchor + text)
    p.write_text(s)
    return dst


def stats(x):
    x = np.asarray(x, dtype=np.float64)
    return {"median": float(np.median(x)), "p10": float(np.percentile(x, 10)), "p90": float(np.percentile(x, 90))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128:512,128:1024,128:8192")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    for fam in families.REGISTRY.values():
        _compile.kernel_fingerprint(fam)  # cached: the tuned table keys on the real sources
    kdir = patched_kernel_dir(pathlib.Path(tempfile.mkdtemp(prefix="cuflash-trace-")))
    _compile.kernel_dir = lambda: kdir
    modules = {}
    real_load = _compile._load

    def load(source, name, smem_bytes, device_id, arch=None, cubin=None):
        if "fwd_sm90" not in name:
            return real_load(source, name, smem_bytes, device_id, arch, cubin)
        opts = _compile.nvrtc_options((f"--gpu-architecture={arch}",) if arch else ())
        mod = cupy.RawModule(code=source, options=opts, backend="nvrtc")
        fn = mod.get_function(name)
        if smem_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem_bytes
        modules["fwd"] = (mod, name)
        return fn

    _compile._load = load
    rows = []
    for spec in a.shapes.split(","):
        d, n = (int(x) for x in spec.split(":"))
        h, b = 2048 // d, max(1, 16384 // n)
        rng = np.random.default_rng(0)
        q, k, v = testing.random_qkv(rng, b, n, n, h, d, testing.bf16())
        modules.clear()
        for key in [k2 for k2 in _compile._loaded if "Sm90FwdConfig" in type(k2[0]).__name__]:
            del _compile._loaded[key]  # each shape compiles (and traces) its own module
        for _ in range(5):
            cuflash.attention(q, k, v, causal=a.causal)
        if "fwd" not in modules:
            raise SystemExit("the call did not compile the traced sm90 forward (already loaded in this process?)")
        mod, name = modules["fwd"]
        buf = cupy.ndarray((262144 * 8,), cupy.uint64, mod.get_global("cuflash_fwd_trace"))
        buf.fill(0)
        cupy.cuda.Device().synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        cuflash.attention(q, k, v, causal=a.causal)
        stop.record()
        stop.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, stop)
        t = buf.get().reshape(-1, 8).astype(np.int64)
        used = t[:, 0] > 0
        t = t[used]
        t0 = t[:, [0, 4]][t[:, [0, 4]] > 0].min()
        row = {"head_dim": d, "seqlen": n, "causal": a.causal, "kernel": name, "tiles": int(used.sum()), "call_ms": ms}
        print(f"d{d} N{n} {'causal' if a.causal else 'dense'} {name}: {row['tiles']} tiles, call {ms * 1e3:.1f} us")
        span = 0
        for c in (0, 1):
            tc = t[:, 4 * c:4 * c + 4]
            tc = tc[tc[:, 0] > 0]
            if not len(tc):
                continue
            ph = {"receive_to_q": tc[:, 1] - tc[:, 0], "q_to_epilogue": tc[:, 2] - tc[:, 1],
                  "epilogue": tc[:, 3] - tc[:, 2], "tile_total": tc[:, 3] - tc[:, 0]}
            row[f"consumer{c}"] = {k2: stats(v2) for k2, v2 in ph.items()}
            span = max(span, int(tc[:, 3].max() - t0))
            for k2, v2 in row[f"consumer{c}"].items():
                print(f"   c{c} {k2:14s} median {v2['median']:8.0f} ns  p10 {v2['p10']:8.0f}  p90 {v2['p90']:8.0f}")
            share = (tc[:, 3] - tc[:, 2]).sum() / (tc[:, 3] - tc[:, 0]).sum()
            print(f"   c{c} epilogue share of tile time {100 * share:.1f}%")
        row["span_us"] = span / 1e3
        rows.append(row)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
