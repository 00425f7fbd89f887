"""One bf16 forward (the automatic kernel: the sm90 one on an H200), 16k tokens (batch 16384 // N, N 8192
unless --n), 2048 / head_dim heads, for
`ncu -k regex:fwd_sm90 --launch-skip 3 -c 1 --section ... python scripts/profile_fwd.py [--alibi] [--softcap] [--causal] [--d 64] [--n 512] [--varlen]`
(issue 13's ALiBi and softcap costs: the same launch with and without them). Warm-up runs come first.
--varlen: scripts/bench_varlen.py's ragged batch instead (its ten lengths, 16,384 tokens) through
cuflash.attention_varlen (issue 12's varlen forward against dense batch x 2048).
--cudnn: SDPA's cuDNN backend on the same shape instead (its kernel: `-k regex:fprop`), to set its
pipes beside ours."""
import sys

import cupy
import numpy as np

import cuflash
from cuflash import testing

causal = "--causal" in sys.argv
d = int(sys.argv[sys.argv.index("--d") + 1]) if "--d" in sys.argv else 128
h = 2048 // d  # the benchmark's heads (hidden 2048)
n = int(sys.argv[sys.argv.index("--n") + 1]) if "--n" in sys.argv else 8192
rng = np.random.default_rng(0)
q, k, v = testing.random_qkv(rng, max(1, 16384 // n), n, n, h, d, testing.bf16())
slopes = cupy.asarray((2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)) if "--alibi" in sys.argv else None
softcap = 30.0 if "--softcap" in sys.argv else 0.0
if "--varlen" in sys.argv:  # bench_varlen.py's lengths (seed 0, drawn from 256..4096, 16,384 tokens)
    import bench_varlen  # beside this script

    lens = bench_varlen._lengths(16384, np.random.default_rng(0))
    q, k, v = (x.reshape(1, 16384, h, d)[0] for x in testing.random_qkv(rng, 1, 16384, 16384, h, d, testing.bf16()))
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    for _ in range(4):
        cuflash.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    cupy.cuda.Device().synchronize()
elif "--cudnn" in sys.argv:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(4):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    torch.cuda.synchronize()
else:
    for _ in range(4):
        cuflash.attention(q, k, v, causal=causal, alibi_slopes=slopes, softcap=softcap)
    cupy.cuda.Device().synchronize()
print("done")
