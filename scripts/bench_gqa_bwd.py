"""Issue 12's GQA backward figure in one process: GQA (32 query / 8 K/V heads) with the group loop,
GQA through the expanded buffers and bwd_dkdv_reduce (the loop switched off), and MHA (32 / 32), at
head_dim 128, seqlen 8192, batch 2, bf16, timed in alternating rounds (CUDA events, median).

    python scripts/bench_gqa_bwd.py [--causal 0 1] [--rounds 5] [--reps 10] [--json out.json]

TFLOP/s count the MHA FLOPs of the shape (the same for all three: 2.5 x 4 B H N^2 D, halved causal).
"""
from __future__ import annotations

import argparse
import json
import statistics


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--chunks", type=int, nargs="+", default=[],
                   help="also time the group loop with these causal head chunks (cuflash/params.py "
                        "GQA_CAUSAL_HEAD_CHUNK; the loop itself runs the default, gqa_causal_chunk's L2 rule; "
                        "16 or more: the whole grid of this shape)")
    p.add_argument("--json")
    a = p.parse_args()

    import cupy
    import numpy as np

    import cuflash
    from cuflash import _backward
    from cuflash import params as _params
    from cuflash.testing import dtype_of

    b, h, n, d = 2, 32, a.seqlen, 128
    dt = dtype_of("bfloat16")
    rng = np.random.default_rng(0)
    mk = lambda *s: cupy.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dt)
    loop_waves = _backward.GROUP_LOOP_MIN_WAVES
    rows = []
    for causal in a.causal:
        variants = {}
        for name, hk in (("gqa_loop", 8), ("gqa_expanded", 8), ("mha", 32)):
            q, k, v, dout = mk(b, n, h, d), mk(b, n, hk, d), mk(b, n, hk, d), mk(b, n, h, d)
            out, lse = cuflash.attention(q, k, v, causal=bool(causal), return_lse=True)
            variants[name] = (q, k, v, dout, out, lse)
        for c in a.chunks if causal else []:
            variants[f"gqa_loop_chunk{c}"] = variants["gqa_loop"]
        flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
        times = {k: [] for k in variants}
        for _ in range(a.rounds):
            for name, (q, k, v, dout, out, lse) in variants.items():
                _backward.GROUP_LOOP_MIN_WAVES = 10**9 if name == "gqa_expanded" else loop_waves
                _params.GQA_CAUSAL_HEAD_CHUNK = int(name[14:]) if name.startswith("gqa_loop_chunk") else None
                _backward._plans.clear()
                run = lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=bool(causal))  # noqa: B023
                for _ in range(3):
                    run()
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                per = []
                for _ in range(a.reps):
                    e0.record()
                    run()
                    e1.record()
                    e1.synchronize()
                    per.append(cupy.cuda.get_elapsed_time(e0, e1))
                times[name].append(statistics.median(per))
        _backward.GROUP_LOOP_MIN_WAVES = loop_waves
        _params.GQA_CAUSAL_HEAD_CHUNK = None
        tf = {k: flops / (statistics.median(t) * 1e-3) / 1e12 for k, t in times.items()}
        row = {"causal": causal, **{f"{k}_tflops": round(x, 1) for k, x in tf.items()},
               "loop_over_mha": round(tf["gqa_loop"] / tf["mha"], 3),
               "expanded_over_mha": round(tf["gqa_expanded"] / tf["mha"], 3),
               **{f"{k[9:]}_over_mha": round(x / tf["mha"], 3) for k, x in tf.items() if k.startswith("gqa_loop_")},
               "rounds_ms": {k: [round(x, 3) for x in t] for k, t in times.items()}}
        rows.append(row)
        print(f"causal={causal}: GQA loop {tf['gqa_loop']:.1f}, GQA expanded {tf['gqa_expanded']:.1f}, MHA "
              f"{tf['mha']:.1f} TFLOP/s; loop / MHA {row['loop_over_mha']}, expanded / MHA {row['expanded_over_mha']}"
              + "".join(f", {k[:-9]} / MHA {x}" for k, x in row.items() if k.startswith("chunk")))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
