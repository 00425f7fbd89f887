"""A few small ragged forward cases for compute-sanitizer (memcheck, racecheck); no memory pool."""
import numpy as np
import cupy

cupy.cuda.set_allocator(None)  # pool-less, so an out-of-bounds access is not hidden inside a pool block

import cuflash  # noqa: E402
from cuflash._forward_v1 import forward_v1  # noqa: E402
from cuflash.testing import dtype_of, random_qkv  # noqa: E402

rng = np.random.default_rng(0)
for d in (64, 128):
    for nq, nk in ((1, 1), (17, 113), (129, 17)):
        for causal in (False, True):
            q, k, v = random_qkv(rng, 1, nq, nk, 2, d, dtype_of("bfloat16"))
            cuflash.attention(q, k, v, causal=causal)
            forward_v1(q, k, v, causal=causal)
# v1 with several K/V tiles and Q tiles: the fp32 workspace round trips and the Q ring
for nq, nk in ((300, 200), (130, 520)):
    for causal in (False, True):
        q, k, v = random_qkv(rng, 1, nq, nk, 2, 128, dtype_of("bfloat16"))
        forward_v1(q, k, v, causal=causal)
cupy.cuda.Device().synchronize()
print("sanitize cases done")
# backward: atomic dQ and deterministic dQ, ragged and causal with Nq != Nk
from cuflash import _backward, _forward  # noqa: E402

for d in (64, 128):
    for nq, nk in ((37, 150), (150, 37), (200, 200)):
        for causal in (False, True):
            q, k, v = random_qkv(rng, 1, nq, nk, 2, d, dtype_of("bfloat16"))
            out, lse = _forward.forward(q, k, v, causal=causal)
            for det in (False, True):
                _backward.backward(out, q, k, v, out, lse, causal=causal, deterministic=det)
cupy.cuda.Device().synchronize()
print("sanitize backward cases done")
# dropout: v1 and v2 forward, both backward paths
for d in (64, 128):
    for nq, nk in ((37, 150), (150, 37)):
        q, k, v = random_qkv(rng, 1, nq, nk, 2, d, dtype_of("bfloat16"))
        for algorithm in ("v1", "v2"):
            cuflash.attention(q, k, v, causal=True, algorithm=algorithm, dropout_p=0.2, seed=7)
        out, lse = _forward.forward(q, k, v, causal=True, dropout_p=0.2, seed=7)
        for det in (False, True):
            _backward.backward(out, q, k, v, out, lse, causal=True, deterministic=det, dropout_p=0.2, seed=7)
cupy.cuda.Device().synchronize()
print("sanitize dropout cases done")
