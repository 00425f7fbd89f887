"""One d128 N8192 bf16 backward (the automatic one: the sm90 dK/dV kernel on an H200), for
`ncu -k regex:bwd_sm90 -c 1 --set full python scripts/profile_bwd.py` (issue 11's profile).
Warm-up runs first, so the profiled launch is a steady-state one; --causal for the causal mask."""
import sys

import numpy as np

import cuflash
from cuflash import testing

causal = "--causal" in sys.argv
rng = np.random.default_rng(0)
q, k, v = testing.random_qkv(rng, 2, 8192, 8192, 16, 128, testing.bf16())
dout = testing.random_qkv(rng, 2, 8192, 8192, 16, 128, testing.bf16())[0]
out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
for _ in range(3):
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
import cupy  # noqa: E402

cupy.cuda.Device().synchronize()
print("done")
