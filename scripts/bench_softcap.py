"""Softcap's cost against the plain forward (issue 13's bar: at most 10%), same run, same shapes,
per sm90 forward tile: the automatic one and each of the family's defaults for the head dim, so a
tile choice for softcap can be read off. Also a snippet cap (the 5% bar against the built-in).

    python scripts/bench_softcap.py [--head-dims 128 64] [--seqlens 2048 8192] [--causal] [--json out.json]

bf16, 16 heads (d128) or 32 (d64), batch 16384 / N, the sm90 forward on an H200. Alternating
rounds, the median round of each (cuflash._timing's CUDA events inside)."""
from __future__ import annotations

import json


def main():
    import cupy

    import cuflash
    from cuflash import _forward, families
    from cuflash._timing import flops_attention, time_rounds, variant_bench_parser, variant_bench_shape
    from cuflash.testing import dtype_of

    p = variant_bench_parser(__doc__, [128, 64])
    p.add_argument("--causal", action="store_true")
    a = p.parse_args()
    bf16 = dtype_of("bfloat16")
    fam = families.REGISTRY["fwd_sm90"]
    rows = []
    for d in a.head_dims:
        for n in a.seqlens:
            b, h = variant_bench_shape(d, n)
            rng = cupy.random.default_rng(0)
            q, k, v = (rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(3))
            cap = cuflash.ScoreMod("30.f * tanh_approx(score / 30.f)")
            fns = {"plain": lambda: cuflash.attention(q, k, v, causal=a.causal),
                   "softcap": lambda: cuflash.attention(q, k, v, causal=a.causal, softcap=30.0),
                   "snippet cap": lambda: cuflash.attention(q, k, v, causal=a.causal, score_mod=cap)}
            for t in fam.defaults[d]:  # fixed tiles: an A/B of kernel sources compares like with like
                fns[f"plain {t}"] = (lambda t=t: _forward.forward(q, k, v, causal=a.causal, config=t))
                fns[f"softcap {t}"] = (lambda t=t: _forward.forward(q, k, v, causal=a.causal, softcap=30.0, config=t))
            for fn in fns.values():
                fn()
            ms = time_rounds(fns, a.rounds, a.reps, a.warmup_ms)
            flops = flops_attention(b, h, n, n, d, a.causal, "fwd")
            tf = {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items()}
            for name, x in tf.items():
                print(f"d{d} N{n:6d} causal={int(a.causal)}  {name:90s} {x:7.1f} TFLOP/s  {x / tf['plain']:6.3f} of plain"
                      f"  {x / tf['softcap']:6.3f} of softcap", flush=True)
                rows.append(dict(head_dim=d, seqlen=n, batch=b, heads=h, causal=a.causal, call=name, tflops=x))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
