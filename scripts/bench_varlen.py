"""Variable-length batches against dense ones of the same useful FLOPs (issue 12's bar: >= 0.9x).

    python scripts/bench_varlen.py [--tokens 16384] [--heads 16] [--head-dim 128] [--rounds 3] [--json out.json]

A ragged batch (lengths drawn from 256..4096, fixed seed, totalling --tokens) runs through
cuflash.attention_varlen, forward and backward; the dense comparison is cuflash.attention on
(batch, 2048) with the batch chosen so that its FLOPs match the ragged batch's useful FLOPs
(sum of 4 heads n_i^2 head_dim, halved when causal), both on the default backend (the Hopper kernels
on an H100/H200) and forced to sm80. CUDA events: each call the median of --rounds alternating
rounds (all eight calls per round), each the median of --reps after a warm-up
(cuflash._timing.time_rounds); bf16.
"""
from __future__ import annotations

import argparse
import json
import statistics

import numpy as np


def _time(fn, reps):
    import cupy

    fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(times)


def _lengths(tokens: int, rng) -> list:
    lens = []
    while sum(lens) < tokens:
        lens.append(int(rng.integers(256, 4097)))
    lens[-1] -= sum(lens) - tokens
    return [n for n in lens if n > 0]


def main():
    import cupy
    import ml_dtypes

    import cuflash
    from cuflash import _backward  # backward(backend=...): the public attention_backward chooses its own
    from cuflash._timing import time_rounds

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-ms", type=float, default=200.0,
                   help="each call kept busy this long before each round's timing (time_cuda's warmup_ms)")
    p.add_argument("--json")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    lens = _lengths(a.tokens, rng)
    h, d, bf = a.heads, a.head_dim, ml_dtypes.bfloat16
    mk = lambda *s: cupy.asarray(rng.standard_normal(s, dtype=np.float32)).astype(bf)
    rows = []
    for causal in (False, True):
        useful = sum(4 * h * n * n * d for n in lens) / (2 if causal else 1)
        q, k, v, dout = (mk(a.tokens, h, d) for _ in range(4))
        cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        mq = max(lens)
        out, lse = cuflash.attention_varlen(q, k, v, cu, cu, mq, mq, causal=causal, return_lse=True)
        n = 2048
        batch = max(1, round(useful / (4 * h * n * n * d / (2 if causal else 1))))
        dense_flops = batch * 4 * h * n * n * d / (2 if causal else 1)
        dq, dk, dv, ddo = (mk(batch, n, h, d) for _ in range(4))
        fns, flops = {}, {}
        for backend in (None, "sm80"):
            tag = backend or "default"
            vtag = "varlen" if backend is None else "varlen_sm80"
            fns[f"{vtag}_fwd"] = lambda b=backend: cuflash.attention_varlen(q, k, v, cu, cu, mq, mq, causal=causal,
                                                                            backend=b)
            fns[f"{vtag}_bwd"] = lambda b=backend: cuflash.attention_varlen_backward(
                dout, q, k, v, out, lse, cu, cu, mq, mq, causal=causal, backend=b)
            o, l_ = cuflash.attention(dq, dk, dv, causal=causal, return_lse=True, backend=backend)
            fns[f"dense_{tag}_fwd"] = lambda b=backend: cuflash.attention(dq, dk, dv, causal=causal, backend=b)
            fns[f"dense_{tag}_bwd"] = lambda b=backend, o=o, l_=l_: _backward.backward(ddo, dq, dk, dv, o, l_,
                                                                                    causal=causal, backend=b)
            flops.update({f"{vtag}_fwd": useful, f"{vtag}_bwd": 2.5 * useful, f"dense_{tag}_fwd": dense_flops,
                          f"dense_{tag}_bwd": 2.5 * dense_flops})
        # alternating rounds: the H200's clock moves by 10-15% between runs and drifts within one, which
        # timing the varlen calls before the dense ones would charge to the ratio
        ms = time_rounds(fns, a.rounds, a.reps, a.warmup_ms)
        row = dict(causal=causal, lengths=lens, useful_tflop=useful / 1e12, dense_batch=batch, dense_seqlen=n,
                   **{name: flops[name] / (t * 1e-3) / 1e12 for name, t in ms.items()})
        rows.append(row)
        print(f"causal={causal}: {len(lens)} sequences ({min(lens)}..{max(lens)}), {a.tokens} tokens; TFLOP/s "
              f"varlen fwd {row['varlen_fwd']:.1f} (sm80 {row['varlen_sm80_fwd']:.1f}) bwd {row['varlen_bwd']:.1f} "
              f"(sm80 {row['varlen_sm80_bwd']:.1f}); dense (batch {batch} x {n}) default "
              f"fwd {row['dense_default_fwd']:.1f} bwd {row['dense_default_bwd']:.1f}, sm80 fwd "
              f"{row['dense_sm80_fwd']:.1f} bwd {row['dense_sm80_bwd']:.1f}; varlen / dense default: fwd "
              f"{row['varlen_fwd'] / row['dense_default_fwd']:.3f} bwd {row['varlen_bwd'] / row['dense_default_bwd']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
