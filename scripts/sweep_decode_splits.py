"""The decode kernel's split counts against its tiles (issue 17: a measured model for num_splits=0).

    python scripts/sweep_decode_splits.py [--cells 1x131072 8x8192 ...] [--json out.json]

bf16, 32 query / 8 K/V heads, d128, one query token, contiguous caches (bench_decode's cells).
Per cell, per decode tile (warps, stages), per split count: the call's time (CUDA events, median)
and its K/V read bandwidth as a ratio to a device copy timed in the same cell, with the tile's
resident blocks per SM and the split count decode_splits would choose. What the split rule in
cuflash/kvcache.py is fitted to: how many blocks per SM, and how deep a ring, reach the copy rate.
"""
from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, ".")

HQ, HKV, D = 32, 8, 128
CELLS = ("1x131072", "8x8192", "8x32768", "64x8192", "64x2048", "4x16384", "2x65536", "16x4096")
SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 29, 32, 33, 40, 48, 64)


def main():
    import cupy

    from cuflash import device, kvcache
    from cuflash._timing import time_cuda
    from cuflash.mask import MaskOptions
    from cuflash.tiles import DecodeConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=list(CELLS))
    ap.add_argument("--tiles", nargs="+", default=["4x2", "4x3", "4x4", "8x2", "2x4"], help="WARPSxSTAGES")
    ap.add_argument("--splits", nargs="+", type=int, default=list(SPLITS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    props = device.query(cupy.cuda.Device().id)
    rows = []
    for cell in a.cells:
        b, n = map(int, cell.lower().split("x"))
        rng = cupy.random.default_rng(0)
        kc, vc = (rng.standard_normal((b, n, HKV, D), dtype=cupy.float32).astype(cupy.float16) for _ in "kv")
        q = rng.standard_normal((b, 1, HQ, D), dtype=cupy.float32).astype(cupy.float16)
        kv_bytes = 2 * kc.nbytes
        src = cupy.empty(kv_bytes // 2, dtype=cupy.float16)
        dst = cupy.empty_like(src)
        t_copy = time_cuda(lambda src=src, dst=dst: cupy.copyto(dst, src), reps=a.reps)["median_ms"]
        del src, dst
        copy_gbps = 2 * kv_bytes / (t_copy * 1e-3) / 1e9
        line = [f"{b:>3} x {n:>6} (copy {copy_gbps:5.0f} GB/s)"]
        for tile in a.tiles:
            w, s = map(int, tile.split("x"))
            cfg = DecodeConfig(D, w, s)
            resident = kvcache.decode_resident(cfg, props)
            key_blocks = -(-n // cfg.block_k)
            chosen = kvcache.decode_splits(HKV * b, resident, props.sm_count, key_blocks,
                                           min_split_blocks=cfg.min_split_blocks)
            res = {}
            for sp in sorted(set(a.splits) | {chosen}):
                if sp > key_blocks:
                    continue
                fn = lambda sp=sp, cfg=cfg, q=q, kc=kc, vc=vc, n=n: kvcache._forward_cupy(  # noqa: E731
                    q, kc, vc, n, None, None, MaskOptions(), None, num_splits=sp, config=cfg)
                try:
                    fn()
                    t = time_cuda(fn, reps=a.reps)["median_ms"]
                except Exception as e:  # a tile that cannot run here: say so, go on
                    rows.append(dict(batch=b, seqlen=n, warps=w, stages=s, splits=sp, error=str(e)[:200]))
                    break
                ratio = kv_bytes / (t * 1e-3) / 1e9 / copy_gbps
                res[sp] = ratio
                rows.append(dict(batch=b, seqlen=n, warps=w, stages=s, splits=sp, resident=resident,
                                 sm_count=props.sm_count, key_blocks=key_blocks, heuristic=chosen,
                                 ms=t, ratio_to_copy=ratio, copy_gbps=copy_gbps))
            if res:
                best = max(res, key=res.get)
                line.append(f"  w{w}s{s} r{resident}: heuristic {chosen} {res.get(chosen, 0):.2f}, best {best} "
                            f"{res[best]:.2f} | " + " ".join(f"{k}:{v:.2f}" for k, v in res.items()))
        print("\n".join(line), flush=True)
        del kc, vc, q
        cupy.get_default_memory_pool().free_all_blocks()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=props.name, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
