"""ALiBi's cost against issue 13's bar (at most 10% against the plain kernel), same run, same shapes.

    python scripts/bench_alibi.py [--head-dims 64 128] [--seqlens 2048 8192] [--json out.json]

bf16, 16 heads (d128) or 32 (d64), batch 16384 / seqlen tokens, causal and not, CuPy arrays. Per cell:
the forward and the backward (atomic dQ) with and without alibi_slopes (FlashAttention-style
geometric slopes, one per head), each on the automatic kernels (a cc 9.0 GPU takes the Hopper forward
and, at d128, the Hopper backward), in TFLOP/s (fwd FLOPs 4 B H N^2 D, halved when causal; bwd 2.5x)
and the ratio ALiBi / plain. CUDA events, median of --reps after a warm-up (cuflash._timing), plain and
ALiBi alternating for --rounds rounds, the median round of each.
"""
from __future__ import annotations

import json


def main():
    import cupy
    import numpy as np

    import cuflash
    from cuflash._timing import flops_attention, time_rounds, variant_bench_parser, variant_bench_shape
    from cuflash.testing import dtype_of

    p = variant_bench_parser(__doc__, [64, 128])
    a = p.parse_args()
    bf16 = dtype_of("bfloat16")
    rows = []
    print("hdim  seqlen  causal  pass   plain TFLOP/s  alibi TFLOP/s  alibi/plain")
    for d in a.head_dims:
        for n in a.seqlens:
            b, h = variant_bench_shape(d, n)
            rng = cupy.random.default_rng(0)
            q, k, v, dout = (rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(4))
            slopes = cupy.asarray((2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32))
            for causal in (False, True):
                for pass_ in ("fwd", "bwd"):
                    fns = {}
                    for name, s in (("plain", None), ("alibi", slopes)):
                        out, lse = cuflash.attention(q, k, v, causal=causal, alibi_slopes=s, return_lse=True)
                        if pass_ == "fwd":
                            fns[name] = lambda s=s: cuflash.attention(q, k, v, causal=causal, alibi_slopes=s)  # noqa: E731
                        else:
                            fns[name] = lambda s=s, out=out, lse=lse: cuflash.attention_backward(  # noqa: E731
                                dout, q, k, v, out, lse, causal=causal, alibi_slopes=s)
                    res = {name: flops_attention(b, h, n, n, d, causal, pass_) / (t * 1e-3) / 1e12
                           for name, t in time_rounds(fns, a.rounds, a.reps, a.warmup_ms).items()}
                    ratio = res["alibi"] / res["plain"]
                    print(f"{d:4d}  {n:6d}  {'yes' if causal else 'no':>6}  {pass_:4}  {res['plain']:13.1f}  "
                          f"{res['alibi']:13.1f}  {ratio:11.3f}", flush=True)
                    rows.append(dict(head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, pass_=pass_,
                                     plain_tflops=res["plain"], alibi_tflops=res["alibi"], ratio=ratio))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
