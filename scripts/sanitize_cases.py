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
# the mma.sync forward forced (on a cc 9.0 GPU the automatic choice is the Hopper kernel), plain and
# with dropout, and the other head dims' forward and backward, fp16
for d in (32, 64, 96, 128, 192, 256):
    q, k, v = random_qkv(rng, 1, 77, 141, 2, d, dtype_of("float16"))
    for causal in (False, True):
        cuflash.attention(q, k, v, causal=causal, backend="sm80")
        cuflash.attention(q, k, v, causal=causal, backend="sm80", dropout_p=0.2, seed=3)
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        cuflash.attention_backward(out, q, k, v, out, lse, causal=causal)
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
# variable-length batches (ragged sequences, one of length 0), forward and backward, both forward backends

lens_q, lens_k = [5, 0, 130, 67], [9, 3, 130, 200]
cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lens_q)]), dtype=cupy.int32)
cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lens_k)]), dtype=cupy.int32)
for d in (64, 128):
    q = cupy.asarray(rng.standard_normal((sum(lens_q), 2, d)), dtype=dtype_of("bfloat16"))
    k = cupy.asarray(rng.standard_normal((sum(lens_k), 2, d)), dtype=dtype_of("bfloat16"))
    v = cupy.asarray(rng.standard_normal((sum(lens_k), 2, d)), dtype=dtype_of("bfloat16"))
    for causal in (False, True):
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            return_lse=True)
        cuflash.attention_varlen_backward(out, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                          causal=causal)
cupy.cuda.Device().synchronize()
print("sanitize varlen cases done")
# KV cache decoding: split-KV partial results and their merge (into the output dtype), ragged cache
# lengths, appended rows, head dims with column splits (192, 256), paged caches of odd page sizes
# (shuffled pages, a table longer than the lengths need), repeated calls (the prepared-call path)
for d in (64, 128, 192, 256):
    kc = cupy.asarray(rng.standard_normal((3, 1000, 2, d)), dtype=dtype_of("bfloat16"))
    vc = cupy.asarray(rng.standard_normal((3, 1000, 2, d)), dtype=dtype_of("bfloat16"))
    q = cupy.asarray(rng.standard_normal((3, 1, 4, d)), dtype=dtype_of("bfloat16"))
    kn = cupy.asarray(rng.standard_normal((3, 1, 2, d)), dtype=dtype_of("bfloat16"))
    for splits in (1, 3):
        for _ in range(2):
            cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=[0, 17, 998], causal=True, num_splits=splits,
                                           k_new=kn, v_new=kn)
    for page in (16, 48):
        per = -(-1000 // page)
        perm = rng.permutation(3 * per).astype(np.int32).reshape(3, per)
        kp = cupy.asarray(rng.standard_normal((3 * per, page, 2, d)), dtype=dtype_of("bfloat16"))
        table = cupy.asarray(perm)
        for splits in (0, 1, 3):
            cuflash.attention_with_kvcache(q, kp, kp, cache_seqlens=[0, page + 1, 999], block_table=table,
                                           causal=True, num_splits=splits, k_new=kn, v_new=kn)
cupy.cuda.Device().synchronize()
print("sanitize kvcache cases done")
