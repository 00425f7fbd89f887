"""One bf16 backward of ours or of SDPA's cuDNN backend, for ncu side by side (issue 11's short cells):

    ncu -k regex:"bwd_sm90|bprop" --launch-skip 3 -c 1 --set full python scripts/profile_bwd_pair.py ours|cudnn [--n 512] [--d 128] [--causal]

The benchmark's shapes: 16k tokens (batch 16384 // n), 2048 / d heads. Warm-up calls first, so the
profiled launch is a steady-state one."""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash

ap = argparse.ArgumentParser()
ap.add_argument("which", choices=["ours", "det", "cudnn"])  # det: ours with deterministic=True (dq_bulk 3)
ap.add_argument("--n", type=int, default=512)
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--causal", action="store_true")
a = ap.parse_args()
b, h = max(1, 16384 // a.n), 2048 // a.d
torch.manual_seed(0)
q, k, v = (torch.randn(b, a.n, h, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
if a.which in ("ours", "det"):
    out, lse = cuflash.attention(q, k, v, causal=a.causal, return_lse=True)
    dout = torch.randn_like(out)
    for _ in range(5):
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=a.causal, deterministic=a.which == "det")
else:
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
        dout = torch.randn_like(out)
        for _ in range(5):
            torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True)
torch.cuda.synchronize()
print("done")
