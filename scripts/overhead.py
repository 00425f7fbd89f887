"""Host overhead of one cuflash.attention call on a tiny problem (launch-bound), vs the kernel alone."""
import time

import cupy
import numpy as np

import cuflash

from cuflash.testing import dtype_of, random_qkv

q, k, v = random_qkv(np.random.default_rng(0), 1, 128, 128, 1, 64, dtype_of("bfloat16"))
for _ in range(20):
    cuflash.attention(q, k, v)
cupy.cuda.Device().synchronize()
n = 2000
t = time.perf_counter()
for _ in range(n):
    cuflash.attention(q, k, v)
cupy.cuda.Device().synchronize()
print(f"cuflash.attention tiny call: {(time.perf_counter() - t) / n * 1e6:.1f} us per call (host-bound)")
