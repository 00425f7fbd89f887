"""Where a small torch forward + backward's host time goes (issue 18): the autograd engine's own
cost for a Python autograd.Function against the backward's own host path, beside SDPA flash.
batch 1, 128 tokens, 2 heads, d64, bf16; wall time of back-to-back calls (median of 5 rounds)."""
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash
from cuflash import _torch as T


def per_call_us(fn, n=500):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t) / n * 1e6)
    return sorted(rounds)[2]


class Scale(torch.autograd.Function):  # the engine's cost for a Python Function with one tiny kernel each way
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


q, k, v, do = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
o = cuflash.attention(qg, kg, vg)
node = o.grad_fn
saved = node.saved_tensors
sdpa = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
    a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2)).transpose(1, 2)
rows = {
    "cuflash fwd, no grad": lambda: cuflash.attention(q, k, v),
    "cuflash fwd, grad recorded": lambda: cuflash.attention(qg, kg, vg),
    "cuflash fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(cuflash.attention(qg, kg, vg), (qg, kg, vg), do),
    "cuflash backward node called directly": lambda: node.apply(do, None),
    "cuflash _bwd_eager (no node)": lambda: T._bwd_eager(do, *saved, node.options, node.fwd_key),
    "Python Function x*2 fwd+bwd": lambda: torch.autograd.grad(Scale.apply(qg), (qg,), do),
    "torch x*2 fwd+bwd (C++ node)": lambda: torch.autograd.grad(qg * 2, (qg,), do),
}
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    rows["SDPA flash fwd"] = lambda: sdpa(q, k, v)
    rows["SDPA flash fwd+bwd"] = lambda: torch.autograd.grad(sdpa(qg, kg, vg), (qg, kg, vg), do)
    for name, fn in rows.items():
        print(f"{name:<40} {per_call_us(fn):8.1f} us", flush=True)
    # the same without the engine's device threads (the backward on the calling thread)
    with torch.autograd.set_multithreading_enabled(False):
        for name in ("cuflash fwd+bwd (autograd.grad)", "Python Function x*2 fwd+bwd", "SDPA flash fwd+bwd"):
            print(f"{name + ', one thread':<40} {per_call_us(rows[name]):8.1f} us", flush=True)

# The Function's own and the engine's cost for it: the kernels' host paths replaced by bare allocations
real_fwd, real_bwd = T._fwd_eager, T._bwd_eager
lse_shape = (1, 2, 128)
T._bwd_eager = lambda dout, q, k, v, out, lse, options, fwd_key=None: (  # noqa: E731
    torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
print(f"{'cuflash fwd+bwd, backward stubbed':<40} {per_call_us(rows['cuflash fwd+bwd (autograd.grad)']):8.1f} us")
T._fwd_eager = lambda q, k, v, options, key=None, ptrs=None: (  # noqa: E731
    torch.empty_like(q), torch.empty(lse_shape, device=q.device, dtype=torch.float32))
print(f"{'cuflash fwd+bwd, both stubbed':<40} {per_call_us(rows['cuflash fwd+bwd (autograd.grad)']):8.1f} us")
print(f"{'cuflash fwd, grad recorded, stubbed':<40} {per_call_us(rows['cuflash fwd, grad recorded']):8.1f} us")
T._fwd_eager, T._bwd_eager = real_fwd, real_bwd
