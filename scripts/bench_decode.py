"""Decode bandwidth against issue 17's bar: one query token per sequence attending to a KV cache.

    python scripts/bench_decode.py [--cells 1x131072 8x8192 ...] [--splits 0 1 4 16] [--json out.json]

bf16, 32 query heads, 8 KV heads, head_dim 128 (Llama-3-8B's attention), contiguous caches of
exactly the attended length. For each cell (batch x cache length):

  * yardstick: a device-to-device copy of a buffer as large as the K/V cache, its bandwidth
    counted as bytes read + written over the time (the GPU's practical memory bandwidth);
  * effective bandwidth of an attention call = the K/V cache bytes it must read (2 x batch x len x
    heads_kv x head_dim x 2 B) over its time, for cuflash.attention_with_kvcache at each
    --splits value (0 = the heuristic) and for PyTorch SDPA (flash and cuDNN backends, enable_gqa,
    the same cache viewed as (batch, heads_kv, len, head_dim));
  * ratios to the yardstick and cuflash's (heuristic splits) ratio to SDPA cuDNN, the issue's bar.

CUDA events, median of --reps after a warm-up (cuflash._timing.time_cuda); the candidates of a cell
take turns over --rounds, and each ratio is the median of the rounds' ratios. Every cache is larger than
the H200's 50 MB L2 except where batch x len is small; the cell list is the issue's.

--graph: every call (ours and SDPA's) is captured --graph-steps times into one CUDA graph and the
replays are timed, as a serving loop runs its decoding step. Eager calls of 64-160 us of K/V are
bounded by the host's time per call on some machines (80-160 us, ours and torch's): without
--graph such cells time the host, and two runs of the same code differ by 20% (perf-notes,
twenty-eighth session).
"""
from __future__ import annotations

import argparse
import json

HQ, HKV, D = 32, 8, 128
CELLS = ("1x131072", "8x8192", "8x32768", "64x8192", "64x2048")


def _cell(s: str) -> tuple[int, int]:
    b, n = s.lower().split("x")
    return int(b), int(n)


def _under(context, fn):
    with context:
        return fn()


def main():
    import cupy
    import numpy as np
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash._timing import time_cuda

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=list(CELLS))
    p.add_argument("--splits", nargs="+", type=int, default=[0, 1, 4, 16, 32])
    p.add_argument("--page-sizes", nargs="*", type=int, default=[16, 256],
                   help="also time paged caches of these page sizes (heuristic splits), as a ratio to contiguous")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays of the calls (see above)")
    p.add_argument("--graph-steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="rounds in which every candidate of a cell is timed in turn")
    p.add_argument("--json")
    a = p.parse_args()

    def eager(fn):
        """A callable that times eager calls of fn (median ms of --reps)."""
        return lambda: time_cuda(fn, reps=a.reps, events="torch", warmup_ms=20)["median_ms"]

    def timer(fn):
        """A callable that times fn: eager calls, or (--graph) replays of a graph of --graph-steps
        calls, captured anew at each call and dropped after its timing. The timer holds fn, and so
        what fn holds (the paged pools): a graph replayed after its inputs were freed reads freed
        memory (an illegal address on an H100, 2026-12-06, when only the graphs were kept)."""
        if not a.graph:
            return eager(fn)

        def once():
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # relaxed: CuPy's pool may allocate during the capture (the calls' outputs)
            with torch.cuda.graph(graph, capture_error_mode="relaxed"), \
                    cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                for _ in range(a.graph_steps):
                    fn()
            t = time_cuda(graph.replay, reps=a.reps, warmup=3, events="torch", warmup_ms=50)["median_ms"]
            torch.cuda.synchronize()
            del graph
            return t / a.graph_steps
        return once

    rows = []
    for cell in a.cells:
        b, n = _cell(cell)
        g = torch.Generator(device="cuda").manual_seed(0)
        kc = torch.randn(b, n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(b, n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        kv_bytes = 2 * kc.numel() * kc.element_size()
        # yardstick: copy a K/V-sized buffer (read + write)
        src = torch.empty(kv_bytes // 2, device="cuda", dtype=torch.bfloat16).normal_()
        dst = torch.empty_like(src)
        row = dict(batch=b, seqlen=n, heads_q=HQ, heads_kv=HKV, head_dim=D, kv_bytes=kv_bytes, graph=a.graph,
                   rounds=a.rounds)
        # (its bandwidth: bytes read + written; eager even with --graph: a graph of 20 copies read
        # 2,440 GB/s on an H100 where eager copies read 3,010, 2026-12-06)
        timers = {"copy": eager(lambda: dst.copy_(src))}
        # cuflash on CuPy views of the same memory (zero-copy), cache length = capacity
        qc, kcc, vcc = (cupy.from_dlpack(x) for x in (q, kc, vc))
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            for s in a.splits:
                fn = lambda s=s: cuflash.attention_with_kvcache(qc, kcc, vcc, cache_seqlens=n, num_splits=s)
                ref = fn()
                timers[f"cuflash_s{s}"] = timer(fn)
            # the lengths as a device array (as serving loops keep them; FlashAttention's cache_seqlens
            # tensor): no per-call upload of host lengths
            lens = cupy.full(b, n, dtype=cupy.int32)
            timers["cuflash_devlens"] = timer(lambda: cuflash.attention_with_kvcache(qc, kcc, vcc, cache_seqlens=lens))
            # paged copies of the cache: shuffled pages, the same rows (issue 17: >= 0.95x contiguous)
            for ps in a.page_sizes:
                per = -(-n // ps)
                perm = torch.randperm(b * per, device="cuda", generator=g).to(torch.int32).reshape(b, per)
                pool = [torch.zeros(b * per, ps, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                for dst_, src_ in zip(pool, (kc, vc)):
                    pad = torch.zeros(b, per * ps, HKV, D, device="cuda", dtype=torch.bfloat16)
                    pad[:, :n] = src_
                    dst_[perm.reshape(-1).long()] = pad.reshape(-1, ps, HKV, D)
                    del pad
                kp, vp, tab = (cupy.from_dlpack(x) for x in (*pool, perm))
                timers[f"paged{ps}"] = timer(lambda kp=kp, vp=vp, tab=tab: cuflash.attention_with_kvcache(
                    qc, kp, vp, cache_seqlens=n, block_table=tab))
        # SDPA: (batch, heads, len, head_dim) views of the same cache, GQA by enable_gqa
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                    out = fn()
                    t = timer(fn)
                # (the backend is chosen per eager call, or at each capture, inside the context)
                timers[name] = lambda t=t, backend=backend: _under(sdpa_kernel(backend), t)
                if name == "sdpa_cudnn":  # the same result (a sanity check of the harness, not a test)
                    row["max_abs_diff_vs_cudnn"] = float((torch.from_dlpack(ref).transpose(1, 2).float()
                                                          - out.float()).abs().max())
            except RuntimeError as e:
                row[f"{name}_error"] = str(e).splitlines()[0][:200]
        # the candidates take turns, round by round (a cell's machine state, clocks included, drifts
        # over seconds: one after the other, the last timed read several % off the first); each
        # figure is the median over the rounds, each ratio the median of the rounds' ratios
        times = {k: [] for k in timers}
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):  # (eager calls: torch's stream)
            for _ in range(a.rounds):
                for k, tm in timers.items():
                    times[k].append(tm())
        med = {k: float(np.median(v)) for k, v in times.items()}
        row["copy_gbps"] = copy_bw = 2 * kv_bytes / (med["copy"] * 1e-3) / 1e9
        for k, v in med.items():
            if k != "copy":
                row[f"{k}_gbps"] = kv_bytes / (v * 1e-3) / 1e9
        for name in ("sdpa_flash", "sdpa_cudnn"):
            row.setdefault(f"{name}_gbps", None)
        ratio = lambda k, ref_k: float(np.median(np.array(times[ref_k]) / np.array(times[k])))  # noqa: E731
        if "sdpa_cudnn" in times:
            row["cuflash_over_cudnn"] = ratio("cuflash_s0", "sdpa_cudnn")
        for ps in a.page_sizes:
            row[f"paged{ps}_over_contiguous"] = ratio(f"paged{ps}", "cuflash_s0")
        rows.append(row)
        ours = row["cuflash_s0_gbps"]
        cd = row.get("sdpa_cudnn_gbps")
        best = max(row[f"cuflash_s{s}_gbps"] for s in a.splits)
        print(f"{b:>3} x {n:>6}: copy {copy_bw:7.0f} GB/s | cuflash (heuristic) {ours:7.0f} = {ours / copy_bw:.2f}x copy"
              f" (best of splits {best / copy_bw:.2f}x) | SDPA flash "
              + (f"{row['sdpa_flash_gbps'] / copy_bw:.2f}x" if row.get("sdpa_flash_gbps") else "n/a")
              + " cuDNN " + (f"{cd / copy_bw:.2f}x" if cd else "n/a")
              + (f" | cuflash / cuDNN {row['cuflash_over_cudnn']:.3f}" if cd else "")
              + f" | device lengths {row['cuflash_devlens_gbps'] / copy_bw:.2f}x copy"
              + " | splits " + " ".join(f"{s}:{row[f'cuflash_s{s}_gbps'] / copy_bw:.2f}" for s in a.splits)
              + "".join(f" | paged {ps}: {row[f'paged{ps}_over_contiguous']:.3f}x contiguous" for ps in a.page_sizes),
              flush=True)
        timers.clear()  # (the calls and the paged pools they hold; the cell's tensors go as the next cell rebinds them)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
