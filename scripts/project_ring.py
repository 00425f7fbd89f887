"""Issue 16's projection: ring attention's per-GPU throughput on 4 and 8 GPUs, from one GPU's times.

    python scripts/project_ring.py [--seqlen 1048576] [--gpus 2 4 8] [--heads 16] [--head-dim 128]
                                   [--link-gbps 360] [--reps 3] [--json out.json]

Machines of 4 and 8 GPUs are not lent (issue 16): this times, on one GPU, every piece of work a rank
does in cuflash/ring.py's schedule for a causal sequence of --seqlen tokens (bf16, zigzag layout)
split over P GPUs, and adds the transfers at --link-gbps (per direction; the 2-GPU exchange that
bench_ring.py's run implies is the number to give). Per rank, with n = seqlen / P:

  forward   step 0: causal attention of its n tokens; steps 1..P-1: an unmasked n x n/2 product
            (all local queries to the block's front half, or the back half of the queries to the
            whole block: the same work) and the LSE merge of its rows into the fp32 accumulator,
            while the next K/V block (2 n heads_kv d x 2 B) moves: step time max(compute, transfer)
  backward  the same products' backward (recomputed from the merged out and lse), dQ, dK, dV added
            to fp32 accumulators, and after each step the block's fp32 dK / dV accumulators
            (2 n heads_kv d x 4 B) sent on and waited for (ring_backward does not overlap them);
            the K/V block moves under the step as in the forward

Per-GPU throughput = causal FLOPs of the whole sequence / P / the rank's time; the ratio is to one
GPU's causal attention of n tokens (bench_ring.py's, issue 16's bar: >= 0.9). Pass --gpus 2 with
--seqlen of a bench_ring.py run to check the model against that measurement first.
"""
from __future__ import annotations

import argparse
import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """One GPU's times (ms) of a rank's pieces of work at P GPUs (shard n = seqlen / P)."""

    causal_fwd: float  # step 0: causal attention of the n local tokens (also the one-GPU baseline)
    causal_bwd: float
    half_fwd: float  # steps 1..P-1: an unmasked n x n/2 product
    half_bwd: float
    merge: float  # the LSE merge of one step's rows into the accumulator (forward)
    accumulate: float  # dQ, dK, dV added to their fp32 accumulators (backward, per step)


def project(p: int, seqlen: int, heads: int, heads_kv: int, head_dim: int, t: StepTimes, link_gbps: float) -> dict:
    """The model above: per-rank forward / backward ms, per-GPU TFLOP/s and the ratios to one GPU at
    the shard's length."""
    n = seqlen // p
    kv_bytes = 2 * n * heads_kv * head_dim * 2
    dkv_bytes = 2 * n * heads_kv * head_dim * 4
    kv_ms = kv_bytes / (link_gbps * 1e9) * 1e3
    dkv_ms = dkv_bytes / (link_gbps * 1e9) * 1e3
    steps = p - 1
    fwd = t.causal_fwd + steps * max(t.half_fwd + t.merge, kv_ms)
    # the diagonal step's dK/dV also go on (every step sends its block's accumulators)
    bwd = t.causal_bwd + t.accumulate + dkv_ms + steps * (max(t.half_bwd + t.accumulate, kv_ms) + dkv_ms)
    flops_fwd = 4 * heads * seqlen * seqlen * head_dim / 2 / p  # a rank's share of the causal FLOPs
    one_flops = 4 * heads * n * n * head_dim / 2
    r = dict(gpus=p, shard=n, fwd_ms=fwd, bwd_ms=bwd, kv_transfer_ms=kv_ms, dkv_transfer_ms=dkv_ms,
             ring_fwd_tflops=flops_fwd / fwd / 1e9, ring_bwd_tflops=2.5 * flops_fwd / bwd / 1e9,
             one_fwd_tflops=one_flops / t.causal_fwd / 1e9, one_bwd_tflops=2.5 * one_flops / t.causal_bwd / 1e9)
    r["fwd_ratio"] = r["ring_fwd_tflops"] / r["one_fwd_tflops"]
    r["bwd_ratio"] = r["ring_bwd_tflops"] / r["one_bwd_tflops"]
    return r


def _measure(p: int, seqlen: int, heads: int, heads_kv: int, head_dim: int, reps: int) -> StepTimes:
    import torch

    import cuflash
    from cuflash._timing import time_cuda

    n = seqlen // p
    g = torch.Generator(device="cuda").manual_seed(p)
    mk = lambda m, h: torch.randn(1, m, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    q, dout = mk(n, heads), mk(n, heads)
    k, v = mk(n, heads_kv), mk(n, heads_kv)
    kh, vh = k[:, : n // 2].contiguous(), v[:, : n // 2].contiguous()

    def ms(fn):
        return time_cuda(fn, warmup=1, reps=reps, events="torch")["median_ms"]

    def fwd_bwd(kk, vv, causal):
        out, lse = cuflash.attention(q, kk, vv, causal=causal, return_lse=True)
        f = ms(lambda: cuflash.attention(q, kk, vv, causal=causal))
        b = ms(lambda: cuflash.attention_backward(dout, q, kk, vv, out, lse, causal=causal))
        return f, b, out, lse

    cf, cb, out, lse = fwd_bwd(k, v, True)
    hf, hb, hout, hlse = fwd_bwd(kh, vh, False)
    acc_out, acc_lse = out.float(), lse.clone()
    merge = ms(lambda: cuflash.merge_attention([acc_out, hout], [acc_lse, hlse], out_dtype=torch.float32))
    dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(
        v, dtype=torch.float32)
    gq, gk, gv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)

    def accumulate():
        dq.add_(gq.float())
        dk.add_(gk.float())
        dv.add_(gv.float())

    return StepTimes(cf, cb, hf, hb, merge, ms(accumulate))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=1 << 20)
    ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--heads-kv", type=int, default=None, help="K/V heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--link-gbps", type=float, required=True,
                    help="GB/s one rank sends to the next while receiving (bench_ring.py's exchange)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    hkv = a.heads_kv or a.heads
    rows = []
    print(f"ring attention projected from one GPU: causal bf16, seqlen {a.seqlen}, heads {a.heads}/{hkv}, "
          f"head_dim {a.head_dim}, link {a.link_gbps:g} GB/s")
    for p in a.gpus:
        if a.seqlen % (2 * p):
            raise SystemExit(f"--seqlen must be a multiple of 2 x {p} for the zigzag layout")
        t = _measure(p, a.seqlen, a.heads, hkv, a.head_dim, a.reps)
        r = {**project(p, a.seqlen, a.heads, hkv, a.head_dim, t, a.link_gbps), "times_ms": dataclasses.asdict(t)}
        rows.append(r)
        print(f"{p} GPUs (shard {r['shard']}): fwd {r['ring_fwd_tflops']:.1f} vs one GPU {r['one_fwd_tflops']:.1f} "
              f"TFLOP/s ({r['fwd_ratio']:.3f}), bwd {r['ring_bwd_tflops']:.1f} vs {r['one_bwd_tflops']:.1f} "
              f"({r['bwd_ratio']:.3f}); per step: K/V {r['kv_transfer_ms']:.2f} ms under {t.half_fwd:.1f} / "
              f"{t.half_bwd:.1f} ms of attention, dK/dV {r['dkv_transfer_ms']:.2f} ms after it", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
