"""Does a kernel's measured speed depend on what the GPU ran just before? The same call timed in
consecutive batches of --calls, after the GPU idled (--idle-s), for cuflash's forward and SDPA's cuDNN
forward (d128 causal and not, bf16, 16k tokens x 16 heads at --seqlen), with the SM clock and power
that `nvidia-smi` reads between batches of a second series. If the first batches after an idle run
faster than the later ones, a count-only warm-up favours whichever backend a bench times first after a
pause (cuflash._timing.time_cuda's warmup_ms is the remedy).

    python scripts/clock_drift.py [--seqlen 8192] [--batches 60] [--calls 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time


def smi():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout.strip().split(",")
        return int(out[0]), float(out[1])
    except Exception:  # noqa: BLE001 - a missing tool only loses the column
        return None, None


def main():
    import cupy
    import ml_dtypes
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--idle-s", type=float, default=1.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    n, d, h = a.seqlen, 128, 16
    b = 16384 // n
    tq, tk, tv = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q, k, v = (cupy.from_dlpack(x.view(torch.int16)).view(ml_dtypes.bfloat16) for x in (tq, tk, tv))
    bq, bk, bv = (x.transpose(1, 2) for x in (tq, tk, tv))
    rows = []
    for causal in (True, False):
        flops = 4 * b * h * n * n * d / (2 if causal else 1)

        def cf():
            return cuflash.attention(q, k, v, causal=causal)

        def cd():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(bq, bk, bv, is_causal=causal)

        for name, fn in (("cuflash", cf), ("cudnn", cd)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            for with_smi in (False, True):
                time.sleep(a.idle_s)
                series = []
                for _ in range(a.batches):
                    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                    e0.record()
                    for _ in range(a.calls):
                        fn()
                    e1.record()
                    e1.synchronize()
                    ms = cupy.cuda.get_elapsed_time(e0, e1) / a.calls
                    clock, power = smi() if with_smi else (None, None)
                    series.append(dict(tflops=round(flops / (ms * 1e-3) / 1e12, 1), clock=clock, power=power))
                rows.append(dict(backend=name, causal=causal, seqlen=n, smi=with_smi, series=series))
                tf = [s["tflops"] for s in series]
                clocks = [s["clock"] for s in series if s["clock"]]
                print(f"{name:8s} causal={causal!s:5s} smi={with_smi!s:5s} first 3 {tf[:3]} | batches 10-12 {tf[10:13]} | "
                      f"last 3 {tf[-3:]}" + (f" | clock {clocks[:2]} .. {clocks[-2:]} MHz" if clocks else ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
