"""Where a paged KV cache loses against a contiguous one (issue 17: >= 0.95x contiguous), timed as
CUDA-graph replays (decode_graph_time.py's method, so the host is out).

Per cell and decode tile (warps, stages; "default" is the library's), the K/V read bandwidth of:
contiguous (device lengths), paged 16 with shuffled pages, paged 16 with the pages in order (the
same kernel and instructions, the reads as contiguous ones), paged 256 shuffled (--layouts: other
page sizes and orders, e.g. 256o 64s 512s). If ordered pages
read as contiguous and shuffled ones do not, the loss is the memory system's (scattered 32 KB
pages), not the kernel's lookups. fp16, 32 query / 8 K/V heads, d128 (--head-dim), one query token.

    python scripts/paged_probe.py [--cells 1x131072 8x8192] [--tiles default 4,4 8,3] [--json f]
"""
from __future__ import annotations

import argparse
import json


def main():
    import cupy

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=["1x131072", "8x8192", "8x32768"])
    ap.add_argument("--tiles", nargs="+", default=["default", "4,4", "8,3", "8,4"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--layouts", nargs="+", default=["16s", "16o", "256s"],
                    help="paged layouts beside the contiguous cache: PAGE_ROWS then s (pages shuffled) or o (in order)")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    for cell in a.cells:
        b, n = map(int, cell.lower().split("x"))
        with stream:
            rows += _cell(b, n, a.head_dim, a)
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


def _cell(b, n, d, a):
    import cupy
    from decode_graph_time import capture, copy_gbps, decode_inputs, replay_ms

    from cuflash.kvcache import _forward_cupy
    from cuflash.mask import MaskOptions
    from cuflash.tiles import DecodeConfig

    q, kc, vc, lens, kv_bytes = decode_inputs(b, n, d)
    gbps = copy_gbps(kv_bytes)
    layouts = {"contiguous": (kc, vc, None)}
    for spec in a.layouts:
        ps, order = int(spec[:-1]), {"s": "shuffled", "o": "ordered"}[spec[-1]]
        kp, tab = _pool(kc, ps, order)
        vp, _ = _pool(vc, ps, order)
        layouts[f"paged{ps}-{order}"] = (kp, vp, tab)
    mask = MaskOptions.of()
    rows = []
    for tname in a.tiles:
        cfg = None if tname == "default" else DecodeConfig(d, *map(int, tname.split(",")))
        line = [f"d{d} {b:>3} x {n:>6} tile {tname:>7}:"]
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
                graph = capture(fn, a.steps)
            except Exception as e:  # noqa: BLE001 (a tile the GPU cannot take: reported, the rest go on)
                line.append(f"{lname} n/a ({str(e).splitlines()[0][:60]})")
                continue
            t = replay_ms(graph, a.steps, a.reps)
            ratio = kv_bytes / (t * 1e-3) / 1e9 / gbps
            base = ratio if lname == "contiguous" else base
            line.append(f"{lname} {ratio:.3f}" + (f" ({ratio / base:.3f}x contig)" if base and lname != "contiguous" else ""))
            rows.append({"head_dim": d, "batch": b, "seqlen": n, "tile": tname, "layout": lname, "us": t * 1e3,
                         "ratio_to_copy": ratio, "copy_gbps": gbps})
        print(" | ".join(line), flush=True)
    return rows


if __name__ == "__main__":
    main()
