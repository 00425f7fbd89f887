"""The Hopper forward's three tile orders against each other (kernels_cu/sm90/tile_feed.cuh), in one run:
one CTA per tile (persistent 0), persistent CTAs striding over the tiles (1), persistent CTAs drawing
their next tile from a counter (2), each on the default tile of the head dim otherwise; on dense
batches (16k tokens x 2048 / head_dim heads) and on bench_varlen.py's ragged batch (10 sequences,
16k tokens, 16 heads, d128) with the dense batch of equal useful FLOPs (issue 12's ratio), with SDPA's
cuDNN backend of the dense shapes as the anchor. TFLOP/s, bf16, CUDA events, median of --reps
(bench_varlen.py's timing).

    python scripts/bench_tile_sched.py [--reps 30] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_varlen import _lengths, _time  # noqa: E402  the same ragged batch and timing


def main():
    import cupy
    import ml_dtypes

    import cuflash
    from cuflash import _forward, families, varlen

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    real = families.select
    order = {"p": None}

    def select(fam, prob):
        t = real(fam, prob)
        return dataclasses.replace(t, persistent=order["p"]) if fam is families.FWD_SM90 and order["p"] is not None else t

    families.select = select
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    mk = lambda *s: cupy.asarray(rng.standard_normal(s, dtype=np.float32)).astype(bf)  # noqa: E731
    rows = []

    def run_orders(fn, flops):
        res = {}
        for p in (0, 1, 2):
            order["p"] = p
            _forward._plans.clear()
            varlen._plans.clear()
            res[f"p{p}"] = round(flops / _time(fn, a.reps) / 1e12, 1)
        order["p"] = None
        _forward._plans.clear()
        varlen._plans.clear()
        return res

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for d in (128, 64):
        h = 2048 // d
        for n in (2048, 8192):
            b = 16384 // n
            q, k, v = (mk(b, n, h, d) for _ in range(3))
            for causal in (False, True):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                row = dict(kind="dense", d=d, n=n, b=b, h=h, causal=causal)
                row.update(run_orders(lambda: cuflash.attention(q, k, v, causal=causal), flops))
                tq, tk, tv = (torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16).transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)  # noqa: E731
                    row["cudnn"] = round(flops / _time(f, a.reps) / 1e12, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    lens = _lengths(16384, np.random.default_rng(0))
    h, d = 16, 128
    q, k, v = (mk(sum(lens), h, d) for _ in range(3))
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    mq = max(lens)
    for causal in (False, True):
        useful = sum(4 * h * n * n * d for n in lens) / (2 if causal else 1)
        row = dict(kind="varlen", lengths=lens, h=h, d=d, causal=causal)
        row.update(run_orders(lambda: cuflash.attention_varlen(q, k, v, cu, cu, mq, mq, causal=causal), useful))
        n = 2048
        batch = max(1, round(useful / (4 * h * n * n * d / (2 if causal else 1))))
        dq, dk, dv = (mk(batch, n, h, d) for _ in range(3))
        dense = run_orders(lambda: cuflash.attention(dq, dk, dv, causal=causal),
                           batch * 4 * h * n * n * d / (2 if causal else 1))
        row.update({f"dense_{key}": val for key, val in dense.items()})
        row.update({f"ratio_{key}": round(row[key] / dense[key], 3) for key in dense})
        rows.append(row)
        print(json.dumps({key: val for key, val in row.items() if key != "lengths"}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
