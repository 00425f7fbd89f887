"""Where a backward call's time goes, kernel by kernel: ours (prep, main, dQ convert) beside SDPA's
cuDNN and flash backends, from CUPTI's kernel records (torch.profiler), on the lent GPU.

    python scripts/bwd_phases.py [--shapes 128:512,128:1024,128:8192,64:512] [--causal both] [--json F]

Each shape: bf16, 16k tokens (batch 16384 // N), 2048 / head_dim heads, as the benchmark. Each
backend's backward runs 300 ms of warm-up, then 20 profiled calls; per kernel name the mean
duration per call (us) and its share of the call's summed kernel time, and the call's span from its
first kernel's start to its last kernel's end (launch gaps included)."""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import cuflash


def _ours(q, k, v, causal):
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    dout = torch.randn_like(out)
    return lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)


def _sdpa(q, k, v, causal, backend):
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    dout = torch.randn_like(out)

    def run():
        with sdpa_kernel([backend]):
            torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True)
    return run


def _profile(fn, calls=20):
    t_end = time.perf_counter() + 0.3
    while time.perf_counter() < t_end:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower()]
    per_name = defaultdict(float)
    for e in kernels:
        per_name[e.name] += (e.time_range.end - e.time_range.start) / calls
    # span per call: kernels sorted by start, split into calls by the synchronize gaps
    starts = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    spans = []
    per_call = max(1, len(starts) // calls)
    for i in range(0, len(starts) - per_call + 1, per_call):
        chunk = starts[i:i + per_call]
        spans.append(max(s[1] for s in chunk) - chunk[0][0])
    spans.sort()
    return dict(per_name), (spans[len(spans) // 2] if spans else None), per_call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128:512,128:1024,128:2048,128:8192,64:512,64:1024")
    ap.add_argument("--causal", default="both", choices=["no", "yes", "both"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    causals = {"no": [False], "yes": [True], "both": [False, True]}[a.causal]
    results = []
    for spec in a.shapes.split(","):
        d, n = (int(x) for x in spec.split(":"))
        h, b = 2048 // d, max(1, 16384 // n)
        for causal in causals:
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
            row = {"head_dim": d, "seqlen": n, "batch": b, "heads": h, "causal": causal, "backends": {}}
            for name, fn in (("cuflash", _ours(q, k, v, causal)),
                             ("sdpa_cudnn", _sdpa(q, k, v, causal, SDPBackend.CUDNN_ATTENTION)),
                             ("sdpa_flash", _sdpa(q, k, v, causal, SDPBackend.FLASH_ATTENTION))):
                kern, span, n_k = _profile(fn)
                total = sum(kern.values())
                row["backends"][name] = {"kernels_us": kern, "kernel_sum_us": total, "span_us": span,
                                         "kernels_per_call": n_k, "tflops_span": flops / (span * 1e-6) / 1e12}
                print(f"d{d} N{n} {'causal' if causal else 'dense '} {name:10s} sum {total:8.1f} us  span "
                      f"{span:8.1f} us  {flops / (span * 1e-6) / 1e12:6.1f} TFLOP/s  ({n_k} kernels)")
                for kn, us in sorted(kern.items(), key=lambda x: -x[1]):
                    print(f"      {us:8.1f} us {100 * us / total:5.1f}%  {kn[:110]}")
            results.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}, "rows": results},
                      f, indent=1, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    main()
