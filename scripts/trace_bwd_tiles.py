"""Where a Hopper backward CTA's time goes, tile by tile: timestamps (%globaltimer, ns) at the phase
boundaries of every CTA of one launch of the sm90 dK/dV kernel, on the lent GPU (issue 11's short
cells, whose per-CTA fixed cost is ~3.5 iterations' time).

    python scripts/trace_bwd_tiles.py [--shapes 128:512,128:8192] [--causal] [--json F]

The kernel is compiled from a patched copy of kernels_cu/ (sm90/bwd.cuh with trace stores behind
anchors of its text; main's sources are untouched) and put in cuflash's kernel cache before the call.
Per CTA: 0 start (thread 0), 1 K/V landed (consumer thread 128), 2 iteration 1 begins, 3 the last
iteration begins, 4 the loop ends, 5 its dK/dV stores issued (its share of the staged rows), 6 the dQ store warp's last reduction
read; slot 7 the SM id. Printed: each phase's median / p10 / p90 over CTAs, and per SM the gap from
one CTA's last stamp to the next CTA's start."""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile

import cupy
import numpy as np

from cuflash import _backward, _compile, testing
from cuflash.features import Features
from cuflash.tiles import Sm90BwdConfig

SLOTS = 8
_PATCHES = [
    # (anchor, text inserted after it)
    ("#include \"sm90/bwd_traits.cuh\"\n",
     ("\n__device__ unsigned long long cuflash_bwd_trace[65536 * 8];\n"
     "__device__ __forceinline__ unsigned long long trace_now() {\n"
     "    unsigned long long t; asm volatile(\"mov.u64 %0, %globaltimer;\" : \"=l\"(t)); return t; }\n"
     "__device__ __forceinline__ unsigned trace_smid() {\n"
     "    unsigned s; asm volatile(\"mov.u32 %0, %smid;\" : \"=r\"(s)); return s; }\n"
     "#define TRACE(slot) (::cuflash_bwd_trace[(long long)blockIdx.x * 8 + (slot)] = ::trace_now())\n")),
    ("    const int tid = threadIdx.x;\n",
     "    if (tid == 0) { TRACE(0); ::cuflash_bwd_trace[(long long)blockIdx.x * 8 + 7] = ::trace_smid(); }\n"),
    ("        if (n_iter > 0) mbar_wait(bar_kv, 0);\n", "        if (tid == 128) TRACE(1);\n"),
    ("            mbar_wait(bar_full(s), (it / STAGES) & 1);\n",
     "            if (tid == 128 && it == 1) TRACE(2);\n            if (tid == 128 && it == n_iter - 1) TRACE(3);\n"),
    ("        // DQ_BULK 2: the last reduction's source is this CTA's shared memory (3, 4: the store warp's)\n",
     "        if (tid == 128) TRACE(4);\n"),
]
_END_ANCHOR = ("                if (v_col) *reinterpret_cast<uint4*>(dvg + (long long)row * params.dv_sn) = b;\n"
               "            }\n        }\n")
_STORE_ANCHOR = "                        if (lane == 0) bulk_wait_read0();\n"


def patched_kernel_dir(tmp: pathlib.Path) -> pathlib.Path:
    dst = tmp / "kernels_cu"
    shutil.copytree(_compile.kernel_dir(), dst)
    p = dst / "sm90" / "bwd.cuh"
    s = p.read_text()
    for anchor, text in _PATCHES + [(_END_ANCHOR, "        if (tid == 128) TRACE(5);\n"),
                                    (_STORE_ANCHOR, "                        if (lane == 0 && it == n_iter - 1) TRACE(6);\n")]:
        assert s.count(anchor) == 1, anchor
        s = s.replace(anchor, anchor + text)
    p.write_text(s)
    return dst


def load_traced(tile, features, kdir):
    source = _compile.kernel_source(tile, features)
    opts = ("--std=c++17", "--use_fast_math", f"-I{kdir}", "--gpu-architecture=sm_90a")
    mod = cupy.RawModule(code=source, options=opts, backend="nvrtc")
    fn = mod.get_function(_compile.kernel_name(tile, features))
    fn.max_dynamic_shared_size_bytes = tile.smem_bytes
    _compile._loaded[(tile, features, cupy.cuda.Device().id)] = fn
    return mod


def stats(x):
    x = np.asarray(x, dtype=np.float64)
    return {"median": float(np.median(x)), "p10": float(np.percentile(x, 10)), "p90": float(np.percentile(x, 90))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128:512,128:2048,128:8192")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tile", default="128,64,2,2,4,1", help="Sm90BwdConfig fields (head dim replaced per shape)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="cuflash-trace-"))
    kdir = patched_kernel_dir(tmp)
    rows = []
    for spec in a.shapes.split(","):
        d, n = (int(x) for x in spec.split(":"))
        h, b = 2048 // d, max(1, 16384 // n)
        fields = [int(x) for x in a.tile.split(",")]
        tile = Sm90BwdConfig(d, *fields[1:])
        feats = Features("bfloat16", d)
        mod = load_traced(tile, feats, kdir)
        rng = np.random.default_rng(0)
        q, k, v = testing.random_qkv(rng, b, n, n, h, d, testing.bf16())
        dout = testing.random_qkv(rng, b, n, n, h, d, testing.bf16())[0]
        import cuflash
        out, lse = cuflash.attention(q, k, v, causal=a.causal, return_lse=True)

        def call(args=(dout, q, k, v, out, lse), tile=tile):
            return _backward.backward(*args, causal=a.causal, config=tile)
        for _ in range(5):
            call()
        trace = mod.get_global("cuflash_bwd_trace")
        buf = cupy.ndarray((65536 * 8,), cupy.uint64, trace)
        buf.fill(0)
        cupy.cuda.Device().synchronize()
        call()
        cupy.cuda.Device().synchronize()
        n_cta = -(-n // tile.block_k) * h * b
        t = buf[: n_cta * 8].get().reshape(n_cta, 8).astype(np.int64)
        if not t[:, 0].any():
            raise SystemExit("no stamps: the call did not run the traced kernel (its features differ from the cache key's)")
        sm = t[:, 7]
        t0 = t[:, 0].min()
        ts = t[:, :7] - t0
        ends = np.maximum(ts[:, 5], ts[:, 6])
        ph = {
            "start_to_kv": ts[:, 1] - ts[:, 0],
            "kv_to_iter1": ts[:, 2] - ts[:, 1],
            "iter1_to_last": ts[:, 3] - ts[:, 2],
            "last_iter": ts[:, 4] - ts[:, 3],
            "epilogue": ts[:, 5] - ts[:, 4],
            "dq_last_read_after_loop": ts[:, 6] - ts[:, 4],
            "cta_total": ends - ts[:, 0],
        }
        n_iter = -(-n // 64)
        per_iter = (ts[:, 3] - ts[:, 2]) / max(1, n_iter - 2)
        gaps = []
        for s in np.unique(sm):
            idx = np.where(sm == s)[0]
            order = idx[np.argsort(ts[idx, 0])]
            gaps += list(ts[order[1:], 0] - ends[order[:-1]])
        row = {"head_dim": d, "seqlen": n, "causal": a.causal, "tile": tile.label(), "ctas": n_cta,
               "span_us": float(ends.max()) / 1e3, "phases_ns": {k2: stats(v2) for k2, v2 in ph.items()},
               "per_iteration_ns": stats(per_iter), "gap_between_ctas_ns": stats(gaps) if gaps else None,
               "ctas_per_sm": stats(np.bincount(sm))}
        rows.append(row)
        print(f"d{d} N{n} {'causal' if a.causal else 'dense'} {tile.label()}: {n_cta} CTAs, span {row['span_us']:.1f} us")
        for k2, v2 in row["phases_ns"].items():
            print(f"   {k2:26s} median {v2['median']:8.0f} ns  p10 {v2['p10']:8.0f}  p90 {v2['p90']:8.0f}")
        pi = row["per_iteration_ns"]
        print(f"   {'per iteration (middle)':26s} median {pi['median']:8.0f} ns  p10 {pi['p10']:8.0f}  p90 {pi['p90']:8.0f}")
        if gaps:
            g = row["gap_between_ctas_ns"]
            print(f"   {'gap between CTAs on an SM':26s} median {g['median']:8.0f} ns  p10 {g['p10']:8.0f}  p90 {g['p90']:8.0f}")
        # the first wave: how synchronised the CTAs' phases are (start spread, K/V landing spread)
        first = np.argsort(ts[:, 0])[:132]
        print(f"   first wave: starts span {np.ptp(ts[first, 0]):.0f} ns, K/V landed {np.percentile(ts[first, 1], 10):.0f}"
              f"-{np.percentile(ts[first, 1], 90):.0f} ns after the first start")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
