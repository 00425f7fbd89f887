"""Issue 13's window bar (a sliding window against full attention) and sinks bar (against plain).

    python scripts/bench_window_sinks.py [--head-dims 128 64] [--seqlens 2048 8192] [--window-seqlen 32768]
                                         [--windows 4096,0 2048,2048] [--window-passes fwd bwd]
                                         [--window-tiles D,BK,C,S,PP,OV,QS,P ...] [--only window|sinks]
                                         [--json out.json]

bf16, CuPy arrays, the automatic kernels (a cc 9.0 GPU takes the Hopper forward and backward).

- **Window** (bar: a window of 4096 at seqlen 32768 reaches at least 0.9x the TFLOP/s of full attention at
  that length, FLOPs counted over the visible entries only): one sequence of --window-seqlen tokens, 16
  heads (d128) or 32 (d64), full non-causal attention against each --windows (left,right) window
  (FlashAttention's window_size; "4096,0" is Mistral's causal sliding window, "2048,2048" a symmetric one
  of the same width). The window's FLOPs count the (query, key) pairs it shows, exactly: 4 D per pair a
  head forward, 2.5x that backward.
  --window-tiles forces each window's forward onto named Hopper tiles as well and prints the block
  granularity's ceiling on each (visible pairs over the pairs its whole blocks compute: 0.970 for 128
  rows x 128 keys at a 4096 window, 0.941 for 128 x 192), to pick a window's tile.
- **Sinks** (bar: at most 10% against the plain kernel): variant_bench_shape's batch and heads at each
  --seqlens, causal and not; forward = attention(sinks=) as the library runs it (since
  2026-12-07 joined in the v2 kernels' epilogue; before: a rescale of out after the kernel) against
  attention(), beside the post-passes after a plain forward (cuflash.sinks.apply's fused kernel, and
  the elementwise steps of before); backward = attention_backward on the rescaled out and lse plus
  cuflash.sinks.grad (the sinks' gradient, one fused kernel; and the elementwise form), against the plain backward.
  Nominal FLOPs throughout.

CUDA events, the variants alternating for --rounds rounds, each round the median of --reps runs after a
--warmup-ms warm-up (cuflash._timing.time_rounds); the median round of each.
"""
from __future__ import annotations

import json


def visible_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """(query, key) pairs a window (left, right) shows, aligned bottom-right as the kernels align it:
    row i sees keys i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right (-1: unbounded)."""
    import numpy as np

    diag = np.arange(seqlen_q, dtype=np.int64) + seqlen_k - seqlen_q
    lo = np.zeros_like(diag) if left < 0 else np.maximum(diag - left, 0)
    hi = np.full_like(diag, seqlen_k - 1) if right < 0 else np.minimum(diag + right, seqlen_k - 1)
    return int(np.maximum(hi - lo + 1, 0).sum())


def visited_pairs(seqlen: int, left: int, right: int, block_q: int, block_k: int) -> int:
    """(query, key) pairs a forward's tiles compute under a window (left, right) at seqlen_q = seqlen_k:
    every visited block pair whole, as kernels_cu/attn/block_range.cuh's key_blocks visits them (padding
    rows and keys of the last blocks included). visible_pairs / this = the block granularity's ceiling
    on a window's TFLOP/s against full attention on the same tile."""
    n_k = -(-seqlen // block_k)
    total = 0
    for r0 in range(0, seqlen, block_q):
        key_end = seqlen if right < 0 else min(seqlen, r0 + block_q - 1 + right + 1)
        key_begin = 0 if left < 0 else max(0, r0 - left)
        end = min(n_k, -(-key_end // block_k))
        total += max(0, end - key_begin // block_k) * block_k * block_q
    return total


def _tile(spec: str):
    from cuflash.tiles import Sm90FwdConfig

    return Sm90FwdConfig(*(int(x) for x in spec.split(",")))


def _window_rows(a, cupy, cuflash, bf16):
    from cuflash import _forward
    from cuflash._timing import time_rounds

    rows = []
    n = a.window_seqlen
    for d in a.head_dims:
        h = 16 if d >= 128 else 32
        rng = cupy.random.default_rng(0)
        q, k, v, dout = (rng.standard_normal((1, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(4))
        variants = {"full": (-1, -1)}
        variants.update({f"window {w[0]},{w[1]}": w for w in a.windows})
        for pass_ in a.window_passes:
            fns, runs = {}, dict(variants)
            for name, w in variants.items():
                if pass_ == "fwd":
                    fns[name] = lambda w=w: cuflash.attention(q, k, v, window_size=w)  # noqa: E731
                    for t in (_tile(spec) for spec in a.window_tiles):  # the same call forced onto a named tile
                        if t.head_dim == d:
                            fns[f"{name} @ {t.label()}"] = lambda w=w, t=t: _forward.forward(  # noqa: E731
                                q, k, v, window_size=w, config=t)
                            runs[f"{name} @ {t.label()}"] = (w, t)
                else:
                    out, lse = cuflash.attention(q, k, v, window_size=w, return_lse=True)
                    fns[name] = lambda w=w, out=out, lse=lse: cuflash.attention_backward(  # noqa: E731
                        dout, q, k, v, out, lse, window_size=w)
            times = time_rounds(fns, a.rounds, a.reps, a.warmup_ms)
            per_pair = 4.0 * h * d * (2.5 if pass_ == "bwd" else 1.0)
            full = per_pair * n * n / (times["full"] * 1e-3) / 1e12
            for name, run in runs.items():
                w, t = run if isinstance(run[0], tuple) else (run, None)
                pairs = visible_pairs(n, n, *w)
                tf = per_pair * pairs / (times[name] * 1e-3) / 1e12
                ceiling = "" if t is None else \
                    f"  (block ceiling {pairs / visited_pairs(n, *w, t.block_q, t.block_k):.3f})"
                print(f"window  d{d:<4d} N{n:<6d} {pass_:4} {name:18s} {times[name]:9.3f} ms  {tf:7.1f} TFLOP/s "
                      f"(visible {pairs / (n * n):.4f})  / full {tf / full:.3f}{ceiling}", flush=True)
                rows.append(dict(bench="window", head_dim=d, seqlen=n, heads=h, pass_=pass_, variant=name,
                                 window=list(w), tile=None if t is None else t.label(), visible_pairs=pairs,
                                 ms=times[name], tflops=tf, ratio_to_full=tf / full))
    return rows


def _elementwise_apply(cupy, out, lse, sinks):
    """The sinks' rescale as cuflash/sinks.py did it before its fused kernel (the 2026-12-07 baseline)."""
    s = sinks.astype(cupy.float32)[None, :, None]
    lse2 = cupy.logaddexp(lse, s)
    w = cupy.transpose(cupy.exp(lse - lse2), (0, 2, 1))[..., None]
    return (out.astype(cupy.float32) * w).astype(out.dtype), lse2


def _elementwise_grad(cupy, dout, out2, lse2, sinks):
    d = cupy.transpose((dout.astype(cupy.float32) * out2.astype(cupy.float32)).sum(-1), (0, 2, 1))
    return -(cupy.exp(sinks.astype(cupy.float32)[None, :, None] - lse2) * d).sum(axis=(0, 2))


def _sinks_rows(a, cupy, cuflash, bf16):
    """Per cell: plain; sinks as cuflash.attention runs them (the backward: attention_backward on out',
    lse' plus cuflash.sinks.grad); and the post-passes after a plain forward: cuflash.sinks.apply and
    the elementwise steps of before (forward), the elementwise gradient (backward)."""
    from cuflash import sinks as sinks_mod
    from cuflash._timing import flops_attention, time_rounds, variant_bench_shape

    rows = []
    for d in a.head_dims:
        for n in a.seqlens:
            b, h = variant_bench_shape(d, n)
            rng = cupy.random.default_rng(0)
            q, k, v, dout = (rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(4))
            sinks = rng.standard_normal(h, dtype=cupy.float32)
            for causal in (False, True):
                for pass_ in ("fwd", "bwd"):
                    if pass_ == "fwd":
                        def plain_then(post):
                            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                            return post(out, lse)

                        fns = {"plain": lambda: cuflash.attention(q, k, v, causal=causal),
                               "sinks": lambda: cuflash.attention(q, k, v, causal=causal, sinks=sinks),
                               "fused post-pass": lambda: plain_then(lambda o, l_: sinks_mod.apply(o, l_, sinks)),
                               "elementwise post-pass": lambda: plain_then(
                                   lambda o, l_: _elementwise_apply(cupy, o, l_, sinks))}
                    else:
                        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                        out2, lse2 = cuflash.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)

                        def with_sinks(grad, out2=out2, lse2=lse2):
                            cuflash.attention_backward(dout, q, k, v, out2, lse2, causal=causal)
                            grad(dout, out2, lse2)

                        fns = {"plain": lambda out=out, lse=lse: cuflash.attention_backward(
                                   dout, q, k, v, out, lse, causal=causal),
                               "sinks": lambda: with_sinks(lambda *x: sinks_mod.grad(*x, sinks)),
                               "elementwise grad": lambda: with_sinks(lambda *x: _elementwise_grad(cupy, *x, sinks))}
                    times = time_rounds(fns, a.rounds, a.reps, a.warmup_ms)
                    res = {name: flops_attention(b, h, n, n, d, causal, pass_) / (t * 1e-3) / 1e12
                           for name, t in times.items()}
                    ratios = {name: res[name] / res["plain"] for name in res}
                    print(f"sinks   d{d:<4d} N{n:<6d} {'causal' if causal else 'full':6} {pass_:4} plain "
                          f"{res['plain']:7.1f} TFLOP/s; / plain: "
                          + ", ".join(f"{name} {r:.3f}" for name, r in ratios.items() if name != "plain"), flush=True)
                    rows.append(dict(bench="sinks", head_dim=d, seqlen=n, batch=b, heads=h, causal=causal,
                                     pass_=pass_, tflops=res, ratio=ratios["sinks"], ratios=ratios))
    return rows


def main():
    import cupy

    import cuflash
    import cuflash.sinks  # noqa: F401  (cuflash.sinks.grad)
    from cuflash._timing import variant_bench_parser
    from cuflash.testing import dtype_of

    p = variant_bench_parser(__doc__, [128, 64])
    p.add_argument("--window-seqlen", type=int, default=32768)
    p.add_argument("--windows", nargs="+", default=["4096,0", "2048,2048"],
                   help="left,right window sizes against full attention at --window-seqlen")
    p.add_argument("--window-tiles", nargs="*", default=[],
                   help="Sm90FwdConfig fields, comma-separated (head_dim,block_k,consumers,stages,pingpong,overlap,"
                        "q_stages,persistent): each window's forward also forced onto each tile of its head dim")
    p.add_argument("--window-passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    p.add_argument("--only", choices=["window", "sinks"], default=None)
    a = p.parse_args()
    a.windows = [tuple(int(x) for x in w.split(",")) for w in a.windows]
    bf16 = dtype_of("bfloat16")
    rows = []
    if a.only in (None, "window"):
        rows += _window_rows(a, cupy, cuflash, bf16)
    if a.only in (None, "sinks"):
        rows += _sinks_rows(a, cupy, cuflash, bf16)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
