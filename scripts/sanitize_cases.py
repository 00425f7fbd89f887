"""A few small ragged forward cases for compute-sanitizer (memcheck, racecheck); no memory pool."""
import numpy as np
import cupy

cupy.cuda.set_allocator(None)  # pool-less, so an out-of-bounds access is not hidden inside a pool block

import cuflash  # noqa: E402
from tests.gpu._oracle import dtype_of, random_qkv  # noqa: E402

rng = np.random.default_rng(0)
for d in (64, 128):
    for nq, nk in ((1, 1), (17, 113), (129, 17)):
        for causal in (False, True):
            q, k, v = random_qkv(rng, 1, nq, nk, 2, d, dtype_of("bfloat16"))
            cuflash.attention(q, k, v, causal=causal)
cupy.cuda.Device().synchronize()
print("sanitize cases done")
