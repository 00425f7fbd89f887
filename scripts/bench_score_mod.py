"""User snippets' cost against the built-ins (issue 13: a snippet that re-expresses softcap within 5%
of the built-in), same run, same shapes.

    python scripts/bench_score_mod.py [--head-dims 128] [--seqlens 2048 8192] [--json out.json]

bf16, 16 heads (d128) or 32 (d64), batch 16384 / N, CuPy arrays, the automatic forward (the sm90
kernel on an H200). Per cell, TFLOP/s (4 B H N^2 D) of: the plain kernel, built-in softcap 30, the
same cap as a snippet on tanh.approx (cuflash's tanh_approx, the built-in's instruction), as a
snippet on tanhf, a per-head bias from an aux array, and a mask snippet (documents of 512 tokens,
counted as full attention), on the automatic backend and on sm80, and with its block mask
(cuflash.BlockMask: the empty blocks skipped; also given as TFLOP/s over the visible scores). Alternating rounds, the
median round of each (cuflash._timing's CUDA events inside).
"""
from __future__ import annotations

import json


def main():
    import cupy
    import numpy as np

    import cuflash
    from cuflash._timing import flops_attention, time_rounds, variant_bench_parser, variant_bench_shape
    from cuflash.testing import dtype_of

    p = variant_bench_parser(__doc__, [128])
    a = p.parse_args()
    bf16 = dtype_of("bfloat16")
    rows = []
    # issue 13's cold-compile bar: a snippet never seen before, its first call (ptxas check, compile,
    # load, launch) in this otherwise warm process
    import time

    q0, k0, v0 = (cupy.random.default_rng(9).standard_normal((1, 256, 2, 128), dtype=cupy.float32).astype(bf16)
                  for _ in range(3))
    cuflash.attention(q0, k0, v0)
    fresh = cuflash.ScoreMod(f"score + {np.random.default_rng().uniform():.8f}f * (float)(kv_idx % 7)")
    t = time.perf_counter()
    cuflash.attention(q0, k0, v0, score_mod=fresh)
    cupy.cuda.Device().synchronize()
    cold = time.perf_counter() - t
    print(f"cold compile of a new snippet (d128, first call): {cold:.2f} s", flush=True)
    for d in a.head_dims:
        for n in a.seqlens:
            b, h = variant_bench_shape(d, n)
            rng = cupy.random.default_rng(0)
            q, k, v = (rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(3))
            bias = cupy.asarray(np.random.default_rng(1).standard_normal(h).astype(np.float32))
            docs = cupy.asarray((np.arange(n) // 512).astype(np.int32))
            doc_mod = cuflash.ScoreMod(mask="doc[q_idx] == doc[kv_idx]", aux={"doc": docs})
            calls = {
                "plain": dict(),
                "softcap": dict(softcap=30.0),
                "snippet cap (tanh_approx)": dict(score_mod=cuflash.ScoreMod("30.f * tanh_approx(score / 30.f)")),
                "snippet cap (tanhf)": dict(score_mod=cuflash.ScoreMod("30.f * tanhf(score / 30.f)")),
                "snippet head bias": dict(score_mod=cuflash.ScoreMod("score + bias[h]", aux={"bias": bias})),
                "snippet doc mask": dict(score_mod=doc_mod),
                "snippet doc mask, sm80": dict(score_mod=doc_mod, backend="sm80"),
                "snippet doc mask + block mask": dict(score_mod=doc_mod, block_mask=doc_mod.block_mask(1, 1, n, n)),
            }
            fns = {name: (lambda kw=kw: cuflash.attention(q, k, v, **kw)) for name, kw in calls.items()}
            for fn in fns.values():
                fn()
            ms = time_rounds(fns, a.rounds, a.reps, a.warmup_ms)
            flops = flops_attention(b, h, n, n, d, False, "fwd")
            tf = {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items()}
            visible = (min(512, n) / n)  # the documents' share of the scores
            bm = tf["snippet doc mask + block mask"]
            print(f"d{d} N{n:6d}  block mask: {bm / tf['snippet doc mask']:.2f}x the doc mask without it "
                  f"({bm / tf['snippet doc mask, sm80']:.2f}x the sm80 one); {bm * visible:.1f} TFLOP/s over the "
                  f"visible scores ({visible:.3f} of them), {bm * visible / tf['plain']:.2f}x plain attention's",
                  flush=True)
            for name, x in tf.items():
                ref = tf["softcap"] if "cap" in name and name != "softcap" else tf["plain"]
                print(f"d{d} N{n:6d}  {name:28s} {x:7.1f} TFLOP/s  {x / ref:6.3f} of "
                      f"{'softcap' if ref is tf['softcap'] else 'plain'}", flush=True)
                rows.append(dict(head_dim=d, seqlen=n, batch=b, heads=h, call=name, tflops=x))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, cold_compile_s=cold), f, indent=1)


if __name__ == "__main__":
    main()
