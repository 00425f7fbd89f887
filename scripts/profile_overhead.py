"""cProfile of cuflash's per-call host work at the overhead shape (issue 18): the CuPy backward and the
torch forward + backward through autograd, 300 calls each, top functions by cumulative time."""
import cProfile
import io
import pstats
import sys

import cupy
import numpy as np

sys.path.insert(0, ".")
import cuflash  # noqa: E402
from cuflash.testing import dtype_of, random_qkv  # noqa: E402


def report(label, fn, n=300):
    for _ in range(20):
        fn()
    cupy.cuda.Device().synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    cupy.cuda.Device().synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(28)
    print(f"===== {label} ({n} calls)\n" + "\n".join(s.getvalue().splitlines()[:60]))


q, k, v = random_qkv(np.random.default_rng(0), 1, 128, 128, 2, 64, dtype_of("bfloat16"))
out, lse = cuflash.attention(q, k, v, return_lse=True)
report("cupy backward", lambda: cuflash.attention_backward(out, q, k, v, out, lse))

import torch  # noqa: E402

tq, tk, tv, tdo = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
tq, tk, tv = (x.requires_grad_() for x in (tq, tk, tv))


def fwd_bwd():
    o = cuflash.attention(tq, tk, tv)
    torch.autograd.grad(o, (tq, tk, tv), tdo)


report("torch fwd+bwd", fwd_bwd)
report("torch fwd (no grad)", lambda: cuflash.attention(tq.detach(), tk.detach(), tv.detach()))
