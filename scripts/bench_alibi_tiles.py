"""ALiBi's d64 Hopper forward per tile: issue 13's two short cells (ALiBi / plain under 0.9).

    python scripts/bench_alibi_tiles.py [--seqlens 2048 8192] [--json out.json]

bf16, d64, 32 heads, batch 16384 / seqlen, causal and not. Per cell: the plain forward on its
automatic tile, then ALiBi on each tile of TILES (the default and the shipped alibi entries, named
explicitly, so what runs does not depend on the tuning table), alternating
(cuflash._timing.time_rounds). Run it under scripts/ab_sources.sh to set two versions of
kernels_cu/sm90/fwd.cuh side by side.
"""
from __future__ import annotations

import json

# (block_k, consumers, stages, pingpong, q_stages, persistent): the d64 default, then the alibi entries
# tuned on the H200 on 2026-12-05 (N2048, N8192, N2048 causal, N8192 causal; all but N2048 causal
# retired on 2026-12-06 when the split bias changed their code), then two more 96-key three-consumer tiles
TILES = [(128, 3, 2, 1, 1, 1), (128, 3, 2, 0, 2, 2), (128, 3, 2, 1, 2, 1), (128, 2, 2, 0, 2, 2), (96, 3, 2, 1, 1, 2),
         (96, 3, 2, 1, 2, 2), (96, 3, 2, 0, 2, 2)]


def main():
    import cupy
    import numpy as np

    import cuflash
    from cuflash._forward import forward
    from cuflash._timing import flops_attention, time_rounds, variant_bench_parser, variant_bench_shape
    from cuflash.tiles import Sm90FwdConfig
    from cuflash.testing import dtype_of

    a = variant_bench_parser(__doc__).parse_args()
    d, bf16, rows = 64, dtype_of("bfloat16"), []
    for n in a.seqlens:
        b, h = variant_bench_shape(d, n)
        rng = cupy.random.default_rng(0)
        q, k, v = (rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(3))
        slopes = cupy.asarray((2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32))
        for causal in (False, True):
            fns = {"plain": lambda: cuflash.attention(q, k, v, causal=causal)}
            for t in TILES:
                cfg = Sm90FwdConfig(head_dim=d, block_k=t[0], consumers=t[1], stages=t[2], pingpong=t[3], overlap=1,
                                    q_stages=t[4], persistent=t[5])
                fns[t] = lambda cfg=cfg: forward(q, k, v, causal=causal, config=cfg, alibi_slopes=slopes)
            ms = time_rounds(fns, a.rounds, a.reps, a.warmup_ms)
            fl = flops_attention(b, h, n, n, d, causal)
            for name, t in ms.items():
                rows.append({"seqlen": n, "causal": causal, "tile": str(name), "ms": t, "tflops": fl / t / 1e9,
                             "vs_plain": ms["plain"] / t})
                print(f"N{n:5d} causal={int(causal)} {str(name):22s} {t:8.4f} ms {fl / t / 1e9:6.1f} TFLOP/s "
                      f"x plain {ms['plain'] / t:.3f}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
