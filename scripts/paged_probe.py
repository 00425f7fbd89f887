"""Where a paged KV cache loses against a contiguous one (issue 17: >= 0.95x contiguous), timed as
CUDA-graph replays (decode_graph_time.py's method, so the host is out).

Per cell and decode tile (warps, stages; "default" is the library's), the K/V read bandwidth of:
contiguous (device lengths), paged 16 with shuffled pages, paged 16 with the pages in order (the
same kernel and instructions, the reads as contiguous ones), paged 256 shuffled. If ordered pages
read as contiguous and shuffled ones do not, the loss is the memory system's (scattered 32 KB
pages), not the kernel's lookups. fp16, 32 query / 8 K/V heads, d128 (--head-dim), one query token.

    python scripts/paged_probe.py [--cells 1x131072 8x8192] [--tiles default 4,4 8,3] [--json f]
"""
from __future__ import annotations

import argparse
import json

HQ, HKV, D = 32, 8, 128


def main():
    import cupy

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=["1x131072", "8x8192", "8x32768"])
    ap.add_argument("--tiles", nargs="+", default=["default", "4,4", "8,3", "8,4"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args()
    global D
    D = a.head_dim
    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    for cell in a.cells:
        b, n = map(int, cell.lower().split("x"))
        with stream:
            rows += _cell(b, n, a)
        cupy.get_default_memory_pool().free_all_blocks()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def _pool(kc, ps, order):
    """kc (b, n, h, d) as pages of ps rows: (pool, table), pages shuffled or in order."""
    import cupy

    b, n, h, d = kc.shape
    per = -(-n // ps)
    ids = cupy.arange(b * per, dtype=cupy.int32)
    if order == "shuffled":
        ids = cupy.random.RandomState(1).permutation(b * per).astype(cupy.int32)
    table = ids.reshape(b, per)
    pad = cupy.zeros((b, per * ps, h, d), dtype=kc.dtype)
    pad[:, :n] = kc
    pool = cupy.empty((b * per, ps, h, d), dtype=kc.dtype)
    pool[table.reshape(-1)] = pad.reshape(-1, ps, h, d)
    return pool, table


def _cell(b, n, a):
    import cupy

    from cuflash._timing import time_cuda
    from cuflash.kvcache import _forward_cupy
    from cuflash.mask import MaskOptions
    from cuflash.tiles import DecodeConfig

    stream = cupy.cuda.get_current_stream()
    rng = cupy.random.default_rng(0)
    kc, vc = (rng.standard_normal((b, n, HKV, D), dtype=cupy.float32).astype(cupy.float16) for _ in "kv")
    q = rng.standard_normal((b, 1, HQ, D), dtype=cupy.float32).astype(cupy.float16)
    lens = cupy.full((b,), n, dtype=cupy.int32)
    kv_bytes = 2 * kc.nbytes
    src = cupy.empty(kv_bytes // 2, dtype=cupy.float16)
    dst = cupy.empty_like(src)
    t_copy = time_cuda(lambda: cupy.copyto(dst, src), reps=30, warmup_ms=50)["median_ms"]
    copy_gbps = 2 * kv_bytes / (t_copy * 1e-3) / 1e9
    layouts = {"contiguous": (kc, vc, None)}
    for ps, order in ((16, "shuffled"), (16, "ordered"), (256, "shuffled")):
        kp, tab = _pool(kc, ps, order)
        vp, _ = _pool(vc, ps, order)
        layouts[f"paged{ps}-{order}"] = (kp, vp, tab)
    mask = MaskOptions.of()
    rows = []
    for tname in a.tiles:
        cfg = None if tname == "default" else DecodeConfig(D, *map(int, tname.split(",")))
        line = [f"d{D} {b:>3} x {n:>6} tile {tname:>7}:"]
        base = ref = None
        for lname, (k, v, tab) in layouts.items():
            def fn(k=k, v=v, tab=tab, cfg=cfg):
                return _forward_cupy(q, k, v, lens, None, None, mask, None, block_table=tab, config=cfg)
            try:
                out = fn()[0]
                if lname == "contiguous":
                    ref = out
                elif float(cupy.abs(out.astype(cupy.float32) - ref.astype(cupy.float32)).max()) > 1e-2:
                    raise AssertionError(f"{lname} differs from contiguous")
                for _ in range(2):
                    fn()
                stream.synchronize()
                stream.begin_capture()
                for _ in range(a.steps):
                    fn()
                graph = stream.end_capture()
            except Exception as e:  # noqa: BLE001 (a tile the GPU cannot take: reported, the rest go on)
                line.append(f"{lname} n/a ({str(e).splitlines()[0][:60]})")
                continue
            t = time_cuda(graph.launch, reps=a.reps, warmup=3, warmup_ms=50)["median_ms"] / a.steps
            ratio = kv_bytes / (t * 1e-3) / 1e9 / copy_gbps
            base = ratio if lname == "contiguous" else base
            line.append(f"{lname} {ratio:.3f}" + (f" ({ratio / base:.3f}x contig)" if base and lname != "contiguous" else ""))
            rows.append({"head_dim": D, "batch": b, "seqlen": n, "tile": tname, "layout": lname, "us": t * 1e3,
                         "ratio_to_copy": ratio, "copy_gbps": copy_gbps})
        print(" | ".join(line), flush=True)
    return rows


if __name__ == "__main__":
    main()
