"""The deterministic backward against the atomic one (issue 11's bar: >= 0.85x), same run.

    PYTHONPATH=$PWD python scripts/bench_deterministic.py [--json out.json] [--head-dims 64 128] [--seqlens 2048 8192] [--no-sm80]

bf16, 16k tokens per batch, heads x head_dim = 2048 (the benchmark's shapes), d64 and d128, seqlen
2048 and 8192, causal and not. Times the default backward (dQ's additions unordered: the Hopper
kernel on an H100/H200, its bulk reductions), the Hopper deterministic mode (forced: backend="sm90") and the sm80 deterministic one
(flash_bwd_dq), CUDA events, median of 20 after 200 ms of warm-up, two input sets rotated; the modes
take turns over --rounds rounds (default 3), each figure the median of its rounds' medians.
"""
import argparse
import json

import cupy
import ml_dtypes
import numpy as np

from cuflash import _backward, _forward
from cuflash._timing import flops_attention, time_cuda

ap = argparse.ArgumentParser()
ap.add_argument("--json")
ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
ap.add_argument("--no-sm80", action="store_true", help="skip the sm80 deterministic backward")
ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per cell (the median of their medians)")
args = ap.parse_args()
modes = (("atomic", {}), ("det_sm90", dict(deterministic=True, backend="sm90")),
         ("det_sm80", dict(deterministic=True, backend="sm80")))[:2 if args.no_sm80 else 3]
rows = []
for d in args.head_dims:
    for n in args.seqlens:
        b, h = 16384 // n, 2048 // d
        for causal in (False, True):
            rot = []
            for _ in range(2):
                q, k, v, dout = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(ml_dtypes.bfloat16)
                                 for _ in range(4))
                out, lse = _forward.forward(q, k, v, causal=causal)
                rot.append((dout, q, k, v, out, lse))
            fb = flops_attention(b, h, n, n, d, causal, "bwd")
            row = dict(head_dim=d, seqlen=n, batch=b, heads=h, causal=causal)
            # the modes take turns, round by round (the clock drifts as the GPU warms; a median of
            # an odd number of rounds' medians: one slow round cannot move it)
            rounds_ms = {name: [] for name, _ in modes}
            for _ in range(args.rounds):
                for name, kw in modes:
                    t = time_cuda(lambda *a, kw=kw: _backward.backward(*a, causal=causal, **kw), rotate=rot, reps=20,
                                  warmup_ms=200)
                    rounds_ms[name].append(t["median_ms"])
            for name, ms in rounds_ms.items():
                row[name] = fb / float(np.median(ms)) / 1e9
            row["round_ms"] = rounds_ms
            rows.append(row)
            sm80 = f", sm80 {row['det_sm80']:.1f} ({row['det_sm80'] / row['atomic']:.3f}x)" if "det_sm80" in row else ""
            print(f"d{d} N{n} causal={int(causal)}: TFLOP/s atomic {row['atomic']:.1f}, deterministic sm90 "
                  f"{row['det_sm90']:.1f} ({row['det_sm90'] / row['atomic']:.3f}x){sm80}", flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
