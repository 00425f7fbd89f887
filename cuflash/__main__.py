"""`python -m cuflash`: the main job. On a GPU, check and time cuflash.attention; without one, say
so plainly and run the CPU reference of both algorithms (v1 and v2 loop orders) on a small problem."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ._version import add_version_argument


def _gpu_reason() -> str | None:
    from .device import cuda_device_count

    n, why = cuda_device_count()
    return None if n else why


def run_cpu_demo(seed: int = 0) -> int:
    from . import reference

    rng = np.random.default_rng(seed)
    b, nq, nk, h, d = 2, 100, 130, 3, 64
    q, k, v = (rng.standard_normal((b, n, h, d)) for n in (nq, nk, nk))
    print(f"CPU reference, float64: batch {b}, seqlen_q {nq}, seqlen_k {nk}, heads {h}, head_dim {d}")
    for causal in (False, True):
        o_ref, lse_ref = reference.attention_naive(q, k, v, causal=causal)
        for name, fn in (("v1 (K/V outer, O/m/l rescaled in memory each step)", reference.attention_v1_tiled),
                         ("v2 (Q outer, one division at the end)", reference.attention_v2_tiled)):
            t = time.perf_counter()
            o, lse = fn(q, k, v, causal=causal, block_q=32, block_k=48)
            dt = time.perf_counter() - t
            fin = np.isfinite(lse_ref)
            err = max(np.abs(o - o_ref).max(), np.abs(lse[fin] - lse_ref[fin]).max())
            print(f"  causal={int(causal)} {name}: max |diff| vs naive {err:.1e} ({dt * 1e3:.0f} ms)")
    return 0


def run_gpu_demo(seqlen: int, head_dim: int) -> int:
    import cupy
    import ml_dtypes

    import cuflash
    from ._timing import flops_attention, time_cuda

    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"]
    batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
    rng = np.random.default_rng(0)
    mk = lambda: cupy.asarray(rng.standard_normal((batch, seqlen, heads, head_dim), dtype=np.float32)).astype(ml_dtypes.bfloat16)
    q, k, v = mk(), mk(), mk()
    # correctness on one head slice against float64
    sl = (slice(0, 1), slice(None), slice(0, 1))
    qs, ks, vs = (cupy.asnumpy(x[sl].astype(cupy.float32)).astype(np.float64) for x in (q, k, v))
    from .reference import attention_naive

    ref, _ = attention_naive(qs[:, :1024], ks[:, :1024], vs[:, :1024], causal=True)
    ours = cuflash.attention(q[sl][:, :1024], k[sl][:, :1024], v[sl][:, :1024], causal=True)
    err = float(np.abs(cupy.asnumpy(ours.astype(cupy.float32)) - ref).max())
    print(f"{name}: bf16 attention, batch {batch}, seqlen {seqlen}, heads {heads}, head_dim {head_dim}")
    print(f"  max |error| vs float64 reference (one head, 1024 tokens, causal): {err:.2e}")
    for causal in (False, True):
        t = time_cuda(lambda: cuflash.attention(q, k, v, causal=causal), warmup=5, reps=30)
        tf = flops_attention(batch, heads, seqlen, seqlen, head_dim, causal) / t["median_ms"] / 1e9
        print(f"  causal={int(causal)}: {t['median_ms']:.3f} ms, {tf:.0f} TFLOP/s")
    print("Compare with PyTorch SDPA: python -m cuflash.bench")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__.splitlines()[0])
    add_version_argument(ap)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128, choices=range(8, 257, 8), metavar="D")
    ap.add_argument("--cpu", action="store_true", help="run the CPU reference demo even if a GPU is present")
    args = ap.parse_args(argv)
    reason = None if not args.cpu else "--cpu given"
    reason = reason or _gpu_reason()
    if reason:
        print(f"No CUDA GPU available ({reason}).")
        print("Running the CPU reference of both FlashAttention algorithms on a small problem instead.\n")
        return run_cpu_demo()
    return run_gpu_demo(args.seqlen, args.head_dim)


if __name__ == "__main__":
    sys.exit(main())
