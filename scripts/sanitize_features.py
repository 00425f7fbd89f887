"""Small ragged cases of the score and mask features for compute-sanitizer (memcheck, racecheck,
synccheck, initcheck), beside scripts/sanitize_cases.py: windows, softcap, ALiBi, sinks, user
snippets (score with its grad, mask) and block masks (the cells and lists passes, and every kernel
walking the lists), with GQA, Nq != Nk (neither a tile multiple), both forward backends and the
backward (the Hopper one at d64 and d128 where it runs), and, forced, the Hopper forward's
column-masking instances, the Hopper backward's fragment-order dQ tiles and its variable-length
instances (deterministic too), and the split-head-dim tile (head_dim 256). No memory pool."""
import numpy as np
import cupy

cupy.cuda.set_allocator(None)  # pool-less, so an out-of-bounds access is not hidden inside a pool block

import cuflash  # noqa: E402
from cuflash.testing import dtype_of  # noqa: E402

rng = np.random.default_rng(0)
bf16 = dtype_of("bfloat16")
b, h, hk = 2, 4, 2


def arr(*shape, dtype=bf16):
    return cupy.asarray(rng.standard_normal(shape), dtype=dtype)


def fwd_bwd(q, k, v, backends=(None, "sm80"), backward=True, **kw):
    for backend in backends:
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend, **kw)
    if backward:
        kw.pop("sinks", None)
        cuflash.attention_backward(arr(*out.shape), q, k, v, out, lse, **kw)


for d in (64, 128):
    for nq, nk in ((37, 150), (150, 37)):
        q, k, v = arr(b, nq, h, d), arr(b, nk, hk, d), arr(b, nk, hk, d)
        fwd_bwd(q, k, v, window_size=(16, 8))
        fwd_bwd(q, k, v, causal=True, softcap=30.0)
        slopes = cupy.asarray(2.0 ** -np.arange(1, h + 1), dtype=cupy.float32)
        fwd_bwd(q, k, v, causal=True, alibi_slopes=slopes)
        fwd_bwd(q, k, v, alibi_slopes=cupy.asarray(rng.uniform(0, 1, (b, h)), dtype=cupy.float32))
        fwd_bwd(q, k, v, causal=True, sinks=cupy.asarray(rng.standard_normal(h), dtype=cupy.float32), backward=False)
        temp = cupy.asarray(rng.uniform(0.5, 2, h), dtype=cupy.float32)
        fwd_bwd(q, k, v, score_mod=cuflash.ScoreMod("score * temp[h]", grad="temp[h]", aux={"temp": temp}))
        docs = cupy.asarray(np.repeat(np.arange(nk), 23)[:max(nq, nk)], dtype=cupy.int32)
        mod = cuflash.ScoreMod(mask="doc[q_idx] == doc[kv_idx]", aux={"doc": docs})
        fwd_bwd(q, k, v, score_mod=mod)
        fwd_bwd(q, k, v, score_mod=mod, block_mask=mod.block_mask(1, 1, nq, nk))
        band = cuflash.ScoreMod(mask="kv_idx <= q_idx + 20 && kv_idx + 40 >= q_idx + h")
        fwd_bwd(q, k, v, causal=True, score_mod=band, block_mask=band.block_mask(1, h, nq, nk))
# the Hopper forward's column-masking instances, forced (rank-4 TMA maps; the automatic choice
# takes sm80 for them): a value head dim of its own (MLA's 192 / 128; 64 / 128: q and k's second
# chunk never loaded) and a head dim between the instances (160 -> 192)
if cupy.cuda.Device().compute_capability == "90":
    for d, dv in ((192, 128), (64, 128), (160, 160)):
        q, k, v = arr(b, 37, h, d), arr(b, 150, hk, d), arr(b, 150, hk, dv)
        fwd_bwd(q, k, v, backends=("sm90",), backward=False, causal=True)
        fwd_bwd(q, k, v, backends=("sm90",), backward=False, window_size=(16, 8), softcap=30.0)
    # the Hopper backward's fragment-order dQ tiles (dq_bulk 2), its variable-length instances, its
    # dropout instances and its deterministic mode, forced
    from cuflash import varlen  # noqa: E402
    from cuflash._backward import backward as backward_with  # noqa: E402
    from cuflash.tiles import Sm90BwdConfig  # noqa: E402

    for d in (64, 128):
        q, k, v = arr(b, 150, h, d), arr(b, 37, h, d), arr(b, 37, h, d)
        out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True)
        backward_with(arr(*out.shape), q, k, v, out, lse, causal=True, config=Sm90BwdConfig(d, 64, 2, 2, 2, 1))
        out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True, dropout_p=0.2, seed=5)
        backward_with(arr(*out.shape), q, k, v, out, lse, causal=True, dropout_p=0.2, seed=5, backend="sm90")
        # the deterministic mode (turn counters in global memory, bulk reductions waited for)
        backward_with(arr(*out.shape), q, k, v, out, lse, causal=True, dropout_p=0.2, seed=5, backend="sm90",
                      deterministic=True)
        out, lse = cuflash.attention(q, k, v, return_lse=True, window_size=(40, 10))
        backward_with(arr(*out.shape), q, k, v, out, lse, window_size=(40, 10), backend="sm90", deterministic=True)
        lens_q, lens_k = [17, 0, 113, 1, 200], [17, 5, 150, 1, 0]
        cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(x)]), dtype=cupy.int32) for x in (lens_q, lens_k))
        q, k, v = arr(sum(lens_q), h, d), arr(sum(lens_k), hk, d), arr(sum(lens_k), hk, d)
        for kw in (dict(causal=True), dict(window_size=(16, 8), softcap=30.0)):
            out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **kw)
            varlen.attention_varlen_backward(arr(*out.shape), q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                             backend="sm90", **kw)
            varlen.attention_varlen_backward(arr(*out.shape), q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                             backend="sm90", deterministic=True, **kw)
    # the split-head-dim tile (head_dim 256, forced): dense with each score path, dropout, GQA, varlen
    q, k, v = arr(b, 150, h, 256), arr(b, 37, hk, 256), arr(b, 37, hk, 256)
    for kw in (dict(causal=True), dict(window_size=(16, 8), softcap=30.0), dict(dropout_p=0.2, seed=5),
               dict(alibi_slopes=cupy.asarray(2.0 ** -np.arange(1, h + 1), dtype=cupy.float32))):
        out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        backward_with(arr(*out.shape), q, k, v, out, lse, backend="sm90", **kw)
        # its dq_bulk 4 twin: dQ staged over the block's own Q / dO images for the store warp
        backward_with(arr(*out.shape), q, k, v, out, lse, backend="sm90", config=Sm90BwdConfig(256, 64, 2, 2, 4, 0), **kw)
    lens_q, lens_k = [17, 0, 113, 1, 200], [17, 5, 150, 1, 0]
    cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(x)]), dtype=cupy.int32) for x in (lens_q, lens_k))
    q, k, v = arr(sum(lens_q), h, 256), arr(sum(lens_k), hk, 256), arr(sum(lens_k), hk, 256)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, causal=True)
    varlen.attention_varlen_backward(arr(*out.shape), q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                     backend="sm90", causal=True)
cupy.cuda.Device().synchronize()
print("sanitize feature cases done")
