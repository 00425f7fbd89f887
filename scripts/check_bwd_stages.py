"""The Hopper backward's tiles against the sm80 backward on a few shapes (bf16, 2 x 1000 x 4 heads,
d64 and d128, causal or not): max |diff| of dq, dk, dv per tile (stages 2 and 3, dQ by atomics or
fragment-order blocks, overlapped or not), to find which tiles compute wrong gradients. A tile that
cannot launch says why (d128 with 3 stages and a dQ staging needs more shared memory than the H200
has: the tuner prunes it, a given config fails at launch).

    python scripts/check_bwd_stages.py
"""
import cupy
import numpy as np

from cuflash import _backward, _forward
from cuflash.tiles import Sm90BwdConfig
from cuflash.testing import dtype_of, random_qkv

rng = np.random.default_rng(0)
for d in (64, 128):
    for causal in (False, True):
        q, k, v = random_qkv(rng, 2, 1000, 1000, 4, d, dtype_of("bfloat16"))
        out, lse = _forward.forward(q, k, v, causal=causal)
        dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32)).astype(q.dtype)
        ref = _backward.backward(dout, q, k, v, out, lse, causal=causal, backend="sm80")
        for s in (2, 3):
            for b in (0, 2, 4):
                for o in (0, 1):
                    t = Sm90BwdConfig(d, 64, 2, s, b, o)
                    try:
                        g = _backward.backward(dout, q, k, v, out, lse, causal=causal, config=t)
                    except Exception as e:
                        print(d, causal, t.label(), "error", str(e)[:80])
                        continue
                    diffs = [float(cupy.max(cupy.abs(x.astype(cupy.float32) - y.astype(cupy.float32)))) for x, y in zip(g, ref)]
                    print(d, "causal" if causal else "dense ", t.label(), " ".join(f"{x:.4f}" for x in diffs), flush=True)
