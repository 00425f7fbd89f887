"""Decode kernel time without the host: each case's call is captured STEPS times into one CUDA graph
and the graph's replays are timed with CUDA events, so a fast host and a slow one read the same.

The bench (bench_decode.py) times eager calls, which at 8 x 8k (64 us of K/V at 4 TB/s) and even
1 x 128k (128 us) are bounded by the host's ~80-160 us a call on some machines: two runs of the same
code then differ by 20%. For an A/B of kernel sources (scripts/ab_sources.sh) this script is the
one to use; run it A, B, A, B to see the drift between runs.

Prints per cell and split count the K/V read bandwidth as a ratio to a device copy in the same cell.
fp16, 32 query heads, 8 K/V heads, d128, one query token, lengths on the device (as a serving loop).
"""
from __future__ import annotations

import argparse
import json

HQ, HKV, D = 32, 8, 128


def main():
    import cupy

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=["1x131072", "2x65536", "8x32768", "8x8192", "16x4096"])
    ap.add_argument("--splits", nargs="+", type=int, default=[0, 16, 32], help="0: the library's choice")
    ap.add_argument("--steps", type=int, default=20, help="calls captured per graph")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tag", default="")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    for cell in a.cells:
        b, n = map(int, cell.lower().split("x"))
        with stream:
            rows += _time_cell(b, n, a)
        cupy.get_default_memory_pool().free_all_blocks()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def decode_inputs(b, n, d=D):
    """One decoding step's fp16 inputs, cache full: (q, k_cache, v_cache, device lengths, K/V bytes)."""
    import cupy

    rng = cupy.random.default_rng(0)
    kc, vc = (rng.standard_normal((b, n, HKV, d), dtype=cupy.float32).astype(cupy.float16) for _ in "kv")
    q = rng.standard_normal((b, 1, HQ, d), dtype=cupy.float32).astype(cupy.float16)
    return q, kc, vc, cupy.full((b,), n, dtype=cupy.int32), 2 * kc.nbytes


def copy_gbps(kv_bytes):
    """The yardstick: a device copy of a K/V-sized buffer, bytes read + written per second / 1e9."""
    import cupy

    from cuflash._timing import time_cuda

    src = cupy.empty(kv_bytes // 2, dtype=cupy.float16)
    dst = cupy.empty_like(src)
    t_copy = time_cuda(lambda: cupy.copyto(dst, src), reps=30, warmup_ms=50)["median_ms"]
    return 2 * kv_bytes / (t_copy * 1e-3) / 1e9


def capture(fn, steps):
    """fn warmed up (compiled, planned), then `steps` calls of it captured into one CUDA graph."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    for _ in range(3):
        fn()
    stream.synchronize()
    stream.begin_capture()
    for _ in range(steps):
        fn()
    return stream.end_capture()


def replay_ms(graph, steps, reps):
    """One call's time in ms: the median replay of a graph of `steps` calls, divided by them."""
    from cuflash._timing import time_cuda

    return time_cuda(graph.launch, reps=reps, warmup=3, warmup_ms=50)["median_ms"] / steps


def _time_cell(b, n, a):
    import cuflash

    q, kc, vc, lens, kv_bytes = decode_inputs(b, n)
    gbps = copy_gbps(kv_bytes)
    line, rows = [f"{a.tag}{b:>3} x {n:>6} (copy {gbps:5.0f} GB/s):"], []
    for sp in a.splits:
        graph = capture(lambda sp=sp: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=sp),
                        a.steps)
        t = replay_ms(graph, a.steps, a.reps)
        ratio = kv_bytes / (t * 1e-3) / 1e9 / gbps
        line.append(f"{sp}:{ratio:.3f} ({t * 1e3:.1f} us)")
        rows.append({"tag": a.tag, "batch": b, "seqlen": n, "splits": sp, "us": t * 1e3,
                     "ratio_to_copy": ratio, "copy_gbps": gbps})
    print(" ".join(line), flush=True)
    return rows


if __name__ == "__main__":
    main()
