"""Ring attention's per-GPU throughput against one GPU at the shard's length (issue 15's bar).

    python scripts/bench_ring.py [--seqlen 262144] [--heads 16] [--head-dim 128] [--json out.json]

One process per visible GPU (NCCL). Each rank times, with CUDA events (median of --reps after a
warm-up), (a) cuflash.distributed.ring_attention forward and forward+backward on its zigzag shard
of a causal sequence of --seqlen tokens, and (b) single-GPU cuflash.attention, causal, on a
sequence of the shard's length. Per-GPU ring throughput = (whole-sequence FLOPs / GPUs) / time;
the ratio to (b)'s throughput is what the issue asks to be >= 0.9. Also the memory each rank
allocates above its inputs at the peak of a ring forward, a ring forward+backward and (b).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile


def _time(fn, reps):
    import torch
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _worker(rank, world, init, a, results):
    import torch
    import torch.distributed as dist

    import cuflash
    from cuflash import distributed as cfd

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        n, h, d, dt = a.seqlen, a.heads, a.head_dim, torch.bfloat16
        local = n // world
        g = torch.Generator(device="cuda").manual_seed(rank)
        q, k, v, dout = (torch.randn(1, local, h, d, device="cuda", generator=g, dtype=dt) for _ in range(4))
        flops_fwd = 4 * h * n * n * d / 2 / world  # causal: half; this rank's share
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

        def passes(attention):  # (forward alone, forward + backward) of attention(q, k, v, causal=True)
            def fwd():
                with torch.no_grad():
                    attention(q, k, v, causal=True)

            def fwd_bwd():
                torch.autograd.grad(attention(qg, kg, vg, causal=True), (qg, kg, vg), dout)

            return fwd, fwd_bwd

        ring_fwd, ring_fwd_bwd = passes(cfd.ring_attention)

        def peak_of(fn):  # bytes allocated at the peak of fn, above what was live before it
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base

        dist.barrier()
        torch.cuda.reset_peak_memory_stats()
        t_rf = _time(ring_fwd, a.reps)
        dist.barrier()
        t_rfb = _time(ring_fwd_bwd, a.reps)
        peak_timed = torch.cuda.max_memory_allocated()  # over back-to-back steps: catches what outlives a step
        dist.barrier()
        peak_rf = peak_of(ring_fwd)
        dist.barrier()
        peak = peak_of(ring_fwd_bwd)
        dist.barrier()

        # the link: one ring exchange of this rank's K/V block (send to the next, receive from the
        # previous, both directions at once), the transfer scripts/project_ring.py's --link-gbps models
        exchange = cfd._Exchange(None, rank, world)
        dist.barrier()
        t_x = _time(lambda: exchange([k, v]).wait(), a.reps)
        exchange_gbps = 2 * k.numel() * k.element_size() / t_x / 1e9

        one_fwd, one_fwd_bwd = passes(cuflash.attention)
        t_of = _time(one_fwd, a.reps)
        t_ofb = _time(one_fwd_bwd, a.reps)
        peak_one = peak_of(one_fwd_bwd)
        flops_one = 4 * h * local * local * d / 2
        r = dict(rank=rank, world=world, seqlen=n, shard=local, heads=h, head_dim=d,
                 ring_fwd_ms=t_rf * 1e3, ring_bwd_ms=(t_rfb - t_rf) * 1e3,
                 one_fwd_ms=t_of * 1e3, one_bwd_ms=(t_ofb - t_of) * 1e3,
                 ring_fwd_tflops=flops_fwd / t_rf / 1e12, ring_bwd_tflops=2.5 * flops_fwd / (t_rfb - t_rf) / 1e12,
                 one_fwd_tflops=flops_one / t_of / 1e12, one_bwd_tflops=2.5 * flops_one / (t_ofb - t_of) / 1e12,
                 peak_mib=peak / 2**20, peak_fwd_mib=peak_rf / 2**20, peak_one_mib=peak_one / 2**20, peak_timed_mib=peak_timed / 2**20,
                 qkv_shard_mib=3 * q.numel() * 2 / 2**20, exchange_ms=t_x * 1e3, exchange_gbps=exchange_gbps)
        r["fwd_ratio"] = r["ring_fwd_tflops"] / r["one_fwd_tflops"]
        r["bwd_ratio"] = r["ring_bwd_tflops"] / r["one_bwd_tflops"]
        results[rank] = r
    finally:
        dist.destroy_process_group()


def main():
    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=262144)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    a = p.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"ring attention needs 2+ GPUs, this machine has {world}")
    if a.seqlen % (2 * world):
        raise SystemExit(f"--seqlen must be a multiple of 2 x GPUs ({2 * world}) for the zigzag layout")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as m:
        results = m.dict()
        mp.spawn(_worker, args=(world, f"file://{os.path.join(tmp, 'init')}", a, results), nprocs=world)
        rows = [dict(results[r]) for r in range(world)]
    print(f"ring attention, {world} GPUs, causal bf16, seqlen {a.seqlen} (shard {a.seqlen // world}), "
          f"heads {a.heads}, head_dim {a.head_dim}; TFLOP/s per GPU, ratio = ring / one GPU at the shard length")
    for r in rows:
        print(f"rank {r['rank']}: fwd {r['ring_fwd_tflops']:.1f} vs {r['one_fwd_tflops']:.1f} ({r['fwd_ratio']:.3f}), "
              f"bwd {r['ring_bwd_tflops']:.1f} vs {r['one_bwd_tflops']:.1f} ({r['bwd_ratio']:.3f}); "
              f"ring fwd {r['ring_fwd_ms']:.1f} ms, bwd {r['ring_bwd_ms']:.1f} ms; memory above the inputs at the "
              f"peak: ring fwd {r['peak_fwd_mib']:.0f} MiB, ring fwd+bwd {r['peak_mib']:.0f} MiB, one GPU fwd+bwd "
              f"{r['peak_one_mib']:.0f} MiB; all allocated at the peak of the timed runs {r['peak_timed_mib']:.0f} MiB (q, k, v shards {r['qkv_shard_mib']:.0f} MiB); "
              f"a K/V exchange {r['exchange_ms']:.2f} ms ({r['exchange_gbps']:.0f} GB/s each way)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
