"""Time every backward config (atomic dQ and deterministic) on a few shapes.

    PYTHONPATH=$PWD python scripts/sweep_bwd.py [--json PATH] [--variants]

--variants also times source variants of the default config (compile-time macros of
kernels_cu/flash_bwd.cuh), for A/B experiments on the kernel.
"""
import argparse
import json

import cupy
import numpy as np

from cuflash import _backward, _compile, _forward, device, families
from cuflash.features import Features
from cuflash._timing import flops_attention, time_cuda
from cuflash.testing import dtype_of, random_qkv

ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
ap.add_argument("--seqlens", type=int, nargs="+", default=[8192])
ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
ap.add_argument("--variants", nargs="*", default=[], help="NAME=VALUE macros to define, one variant each")
ap.add_argument("--default-only", action="store_true", help="time only the default configs")
args = ap.parse_args()

rng = np.random.default_rng(0)
rows = []


def make_sets(b, n, h, d, causal):
    sets = []
    for _ in range(2):
        q, k, v = random_qkv(rng, b, n, n, h, d, dtype_of("bfloat16"))
        out, lse = _forward.forward(q, k, v, causal=causal)
        dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
        sets.append((dout, q, k, v, out, lse))
    return sets


for d in args.head_dims:
    smem = device.query(0).smem_optin
    for n in args.seqlens:
        b, h = max(1, 16384 // n), 2048 // d
        for causal in map(bool, args.causal):
            sets = make_sets(b, n, h, d, causal)
            fl = flops_attention(b, h, n, n, d, causal, "bwd")
            for det in (False, True):
                space = families.BWD_DQ.space(d, smem) if det else families.BWD.space(d, smem)
                if args.default_only:
                    space = [families.BWD_DQ.default(d, smem) if det else families.BWD.default(d, smem)]
                for cfg in space:
                    kw = dict(deterministic=True, dq_config=cfg) if det else dict(config=cfg)
                    t = time_cuda(lambda *a: _backward.backward(*a, causal=causal, **kw), warmup=3, reps=15, rotate=sets)
                    tf = fl / t["median_ms"] / 1e9
                    rows.append(dict(d=d, n=n, causal=causal, deterministic=det, kernel=families.of(cfg).name, cfg=cfg.__dict__,
                                     ms=t["median_ms"], tflops=tf))
                    print(f"d={d} n={n} causal={int(causal)} det={int(det)} {cfg}: {t['median_ms']:.3f} ms {tf:7.1f} TFLOP/s",
                          flush=True)
            for macro in args.variants:
                cfg = families.BWD.default(d, smem)
                feat = Features("bfloat16", cfg.head_dim)
                src = "#define {} {}\n".format(*macro.split("=", 1)) + _compile.kernel_source(cfg, feat)
                fn = _compile._load(src, _compile.kernel_name(cfg, feat), cfg.smem_bytes, 0)
                key = (cfg, feat, 0)  # _compile.get_kernel's memo key
                saved = _compile._loaded.get(key)
                _compile._loaded[key] = fn
                _backward._plans.clear()
                t = time_cuda(lambda *a: _backward.backward(*a, causal=causal, config=cfg), warmup=3, reps=15, rotate=sets)
                print(f"VARIANT {macro} d={d} n={n} causal={int(causal)} {cfg}: {fl / t['median_ms'] / 1e9:7.1f} TFLOP/s")
                if saved is None:
                    _compile._loaded.pop(key)
                else:
                    _compile._loaded[key] = saved
                _backward._plans.clear()
if args.json:
    json.dump(rows, open(args.json, "w"), indent=1)
