"""Time every forward config in the space on a few shapes (the seed of the tuner's exhaustive mode).

    python scripts/sweep_fwd.py [--json PATH]
"""
import argparse
import json

import numpy as np

from cuflash import _forward, device, families
from cuflash._timing import flops_attention, time_cuda
from cuflash.testing import dtype_of, random_qkv

ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
args = ap.parse_args()

rng = np.random.default_rng(0)
rows = []
for d in args.head_dims:
    space = families.FWD.space(d, device.query(0).smem_optin)
    for n in args.seqlens:
        b, h = max(1, 16384 // n), 2048 // d
        sets = [random_qkv(rng, b, n, n, h, d, dtype_of("bfloat16")) for _ in range(2)]
        for causal in (False, True):
            fl = flops_attention(b, h, n, n, d, causal)
            best = None
            for cfg in space:
                t = time_cuda(lambda q, k, v: _forward.forward(q, k, v, causal=causal, config=cfg),
                              warmup=5, reps=20, rotate=sets)
                tf = fl / t["median_ms"] / 1e9
                rows.append(dict(d=d, n=n, causal=causal, cfg=cfg.__dict__, ms=t["median_ms"], tflops=tf))
                best = max(best or (0, None), (tf, cfg), key=lambda x: x[0])
                print(f"d={d} n={n} causal={int(causal)} {cfg.block_q}x{cfg.block_k} w{cfg.warps} s{cfg.stages}: {tf:7.1f} TFLOP/s")
            print(f"BEST d={d} n={n} causal={int(causal)}: {best[1]} {best[0]:.1f}")
if args.json:
    json.dump(rows, open(args.json, "w"), indent=1)
