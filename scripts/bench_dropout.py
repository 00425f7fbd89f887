"""Cost of fused dropout: cuflash fwd/bwd with and without dropout, and SDPA flash with dropout.

    PYTHONPATH=$PWD python scripts/bench_dropout.py [--p 0.1]
"""
import argparse

import cupy
import torch

from cuflash import _backward, _forward
from cuflash._timing import flops_attention, time_cuda

ap = argparse.ArgumentParser()
ap.add_argument("--p", type=float, default=0.1)
args = ap.parse_args()
b, n, h, d = 2, 8192, 16, 128
for causal in (False, True):
    sets = []
    for _ in range(2):
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        sets.append((q, k, v))
    torch.cuda.synchronize()
    cp = [tuple(cupy.from_dlpack(x) for x in s) for s in sets]
    ff, fb = flops_attention(b, h, n, n, d, causal), flops_attention(b, h, n, n, d, causal, "bwd")
    for p in (0.0, args.p):
        kw = dict(causal=causal, dropout_p=p, seed=1234 if p else None)
        tf = time_cuda(lambda q, k, v: _forward.forward(q, k, v, **kw), rotate=cp, reps=20)
        rot = []
        for q, k, v in cp:
            out, lse = _forward.forward(q, k, v, **kw)
            rot.append((out, q, k, v, out, lse))
        tb = time_cuda(lambda *a: _backward.backward(*a, **kw), rotate=rot, reps=20)
        print(f"cuflash causal={int(causal)} p={p}: fwd {ff / tf['median_ms'] / 1e9:.1f} bwd {fb / tb['median_ms'] / 1e9:.1f} TFLOP/s")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for p in (0.0, args.p):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            tsets = [tuple(x.transpose(1, 2) for x in s) for s in sets]
            f = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
            tf = time_cuda(f, rotate=tsets, reps=20, events="torch")
            rot = []
            for q, k, v in tsets:
                q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
                o = f(q, k, v)
                rot.append((o, torch.randn_like(o), q, k, v))
            tb = time_cuda(lambda o, do, q, k, v: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                           rotate=rot, reps=20, events="torch")
        print(f"sdpa_flash causal={int(causal)} p={p}: fwd {ff / tf['median_ms'] / 1e9:.1f} bwd {fb / tb['median_ms'] / 1e9:.1f} TFLOP/s")
