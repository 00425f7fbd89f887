"""The benchmark's round-2 dip (perf-notes, 2026-12-04): our kernels' second round of a case runs up
to 1.28x slower than their first and third while SDPA's move 0-7%. One case of `python -m
cuflash.bench`, its backends in the bench's order and rounds, each (round, backend) printed with its
wall-clock span beside the SM clock, power and throttle reasons NVML reported during it (sampled
every 20 ms by a thread), so a clock or power cap in the slow round shows.

    python scripts/bench_round_clocks.py [--head-dim 128] [--seqlen 2048] [--causal] [--pass bwd] [--rounds 5]
"""
from __future__ import annotations

import argparse
import threading
import time


def main():
    import cupy
    import torch

    from cuflash import bench
    from cuflash._timing import time_cuda

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--pass", dest="pass_", choices=sorted(bench.PASS_BENCHES), default="bwd")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup-ms", type=float, default=300.0)
    a = p.parse_args()

    samples, stop = [], threading.Event()
    try:
        import pynvml  # nvidia-ml-py, where the image has it

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)

        def read():
            return (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                    pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                    pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
    except ImportError:  # nvidia-smi per sample (~50 ms each: fewer samples a window)
        import subprocess

        def read():
            out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                                  "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True).stdout
            clk, pw, reasons = (x.strip() for x in out.split(","))
            return int(clk), float(pw), int(reasons, 16)

    def sample():
        while not stop.is_set():
            samples.append((time.time(), *read()))
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    case = bench.build_cases([a.head_dim], [a.seqlen], 16384, 2048, [a.causal])[0]
    sets = bench.make_inputs(case, "bf16", torch)
    benches = bench.PASS_BENCHES[a.pass_](case, sets, torch)
    print(f"d{a.head_dim} N{a.seqlen} causal={int(a.causal)} {a.pass_}: round backend median_ms | "
          "SM MHz min/median, W median/max, throttle reasons seen (NVML bits)")
    for r in range(a.rounds):
        for name, b in benches.items():
            t0 = time.time()
            with b.context():
                st = time_cuda(b.fn, warmup=10 if r == 0 else 0, reps=50, rotate=b.rotate, events=b.events,
                               warmup_ms=a.warmup_ms)
            t1 = time.time()
            win = [s for s in samples if t0 <= s[0] <= t1] or samples[-1:]
            clk = sorted(s[1] for s in win)
            pw = sorted(s[2] for s in win)
            reasons = 0
            for s in win:
                reasons |= s[3]
            print(f"  {r} {name:12s} {st['median_ms']:8.3f} | {clk[0]:5d}/{clk[len(clk) // 2]:5d} MHz"
                  f"  {pw[len(pw) // 2]:6.1f}/{pw[-1]:6.1f} W  reasons 0x{reasons:x}  ({len(win)} samples)", flush=True)
    stop.set()
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
