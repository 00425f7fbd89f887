"""ALiBi through the KV cache (issue 13 on issue 17's paths): attention_with_kvcache(alibi_slopes=)
on the decode kernel (each packed GQA row its own head's slope), split-KV, the forward kernel for
many rows per K/V head, and paged caches; slopes per head and per (batch, head); the bias aligned
to each batch's length like the mask. Each batch's output checked by the 2x rule against the
float64 reference with the same slopes on that batch's gathered keys; outputs poisoned first."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import kvcache
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule
from tests.gpu.test_kvcache_gpu import CAP, _case

pytestmark = pytest.mark.gpu


def _slopes(rng, batch, h, per_batch):
    import cupy

    base = 2.0 ** (-8.0 * np.arange(1, h + 1) / h) * 1.4
    s = base * rng.uniform(0.5, 1.0, (batch, h)) if per_batch else base
    return cupy.asarray(np.asarray(s, dtype=np.float32))


# (n_q, n_new, h, h_kv, num_splits): one query (decode kernel), a few (still the decode tile:
# group x n_q <= 16), many (the forward kernel), split-KV on the decode kernel and the forward kernel
SHAPES = [(1, 1, 8, 2, 1), (1, 0, 8, 8, 1), (4, 4, 8, 2, 1), (1, 1, 8, 2, 3), (40, 40, 4, 4, 1), (40, 0, 4, 2, 4)]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,d", [("bfloat16", 128), ("float16", 64)])
@pytest.mark.parametrize("nq,n_new,h,hk,splits", SHAPES)
def test_kvcache_alibi(nq, n_new, h, hk, splits, dtype, d, causal, per_batch, paged):
    import cupy

    rng = np.random.default_rng(hash((nq, n_new, h, hk, splits, dtype, d, causal, per_batch, paged)) % 2**32)
    batch = 4
    lens = np.array([0, 1, CAP - n_new, *rng.integers(0, CAP - n_new + 1, batch - 3)], np.int64)
    q, kc, vc, kn, vn = _case(rng, batch, nq, h, hk, d, dtype_of(dtype), lens, n_new)
    slopes = _slopes(rng, batch, h, per_batch)
    mask = MaskOptions.of(causal=causal)
    table = None
    k_arg, v_arg = kc, vc
    if paged:  # pages of 30 rows, shuffled: batch x 10 pages
        ps = 30  # 300 = 10 pages of 30
        n_pages = batch * (CAP // ps)
        perm = rng.permutation(n_pages)
        table = cupy.asarray(perm.reshape(batch, CAP // ps).astype(np.int32))
        k_arg = cupy.empty((n_pages, ps, hk, d), kc.dtype)
        v_arg = cupy.empty_like(k_arg)
        for b in range(batch):
            for i in range(CAP // ps):
                k_arg[perm[b * (CAP // ps) + i]] = kc[b, i * ps:(i + 1) * ps]
                v_arg[perm[b * (CAP // ps) + i]] = vc[b, i * ps:(i + 1) * ps]
    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((batch, h, nq), cupy.nan, dtype=cupy.float32)
    out, lse = kvcache._forward_cupy(q, k_arg, v_arg, lens, kn, vn, mask, None, out=out, lse=lse, num_splits=splits,
                                     block_table=table, alibi_slopes=slopes)
    if n_new:  # the appended rows, for the reference
        for b, n in enumerate(lens):
            kc[b, n:n + n_new] = kn[b]
            vc[b, n:n + n_new] = vn[b]
    scale = 1 / math.sqrt(d)
    for b, n in enumerate(lens + n_new):
        if n == 0:
            assert bool((out[b].astype(cupy.float32) == 0).all())
            continue
        sb = slopes[b:b + 1] if per_batch else slopes
        ob = out[b:b + 1]
        assert not bool(cupy.isnan(ob.astype(cupy.float32)).any()) and not bool(cupy.isnan(lse[b]).any())
        err, pt, allowed = fa_rule(ob, q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], mask, scale, alibi_slopes=sb)
        assert err <= allowed, f"batch {b} (length {n}): max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
        if n > 32 and nq <= n // 2:  # enough keys per row that the bias matters
            plain, _, _ = fa_rule(ob, q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], mask, scale)
            assert plain > 4 * allowed


def test_flash_attn_with_kvcache_takes_alibi():
    import cupy
    from cuflash.flash_attn_interface import flash_attn_with_kvcache

    rng = np.random.default_rng(3)
    lens = np.array([5, 200, 17])
    q, kc, vc, kn, vn = _case(rng, 3, 1, 8, 2, 128, dtype_of("bfloat16"), lens, 1)
    slopes = _slopes(rng, 3, 8, False)
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=cupy.asarray(lens.astype(np.int32)),
                                  causal=True, alibi_slopes=slopes)
    for b, n in enumerate(lens + 1):
        err, _, allowed = fa_rule(out[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], True, 1 / math.sqrt(128),
                                  alibi_slopes=slopes)
        assert err <= allowed


@pytest.mark.parametrize("nq,splits", [(1, 1), (1, 3), (40, 1)])
def test_calls_with_other_slopes_do_not_share_a_plan(nq, splits):
    """One cache, q and options called without slopes, with per-head, with per-batch slopes and
    without again: each call is right (the plans are cached by signature, and the slopes, their
    presence and their shape, are part of it: a per-head plan run for per-batch slopes reads every
    batch's slopes as batch 0's)."""
    rng = np.random.default_rng(11)
    batch, h, hk, d = 4, 8, 2, 64
    lens = np.array([3, 1, CAP - 1, 150], np.int64)
    q, kc, vc, _, _ = _case(rng, batch, nq, h, hk, d, dtype_of("float16"), lens, 0)
    mask = MaskOptions.of(causal=True)
    for slopes in (None, _slopes(rng, batch, h, False), _slopes(rng, batch, h, True), None):
        out, _ = kvcache._forward_cupy(q, kc, vc, lens, None, None, mask, None, num_splits=splits,
                                       alibi_slopes=slopes)
        for b, n in enumerate(lens):
            sb = None if slopes is None else slopes[b:b + 1] if slopes.ndim == 2 else slopes
            err, _, allowed = fa_rule(out[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], mask,
                                      1 / math.sqrt(d), alibi_slopes=sb)
            assert err <= allowed, (None if slopes is None else slopes.shape, b, err, allowed)
