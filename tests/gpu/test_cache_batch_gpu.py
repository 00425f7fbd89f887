"""cache_batch_idx (attention_with_kvcache / flash_attn_with_kvcache, FlashAttention's argument):
batch b of q attends to and appends into sequence cache_batch_idx[b] of a pool of cache sequences.
It runs as a paged cache whose pages are the pool's sequences (cuflash/cache_batch.py), so on the
decode kernel it must give BITWISE the result of the same call on a gathered contiguous copy (the
same rows in the same order, on the same tile), and that result within FlashAttention's rule on
the gather path; the appends land in the indexed sequences and nowhere else. Host and device
(int32, int64) indices; split-KV; GQA; sequences cut into several pages; torch."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import cache_batch, kvcache
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule

pytestmark = pytest.mark.gpu


def _bits_equal(a, b) -> bool:
    import cupy

    return bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("h,hk,n_new", [(32, 8, 1), (8, 8, 0), (8, 2, 9)])  # (8, 2, 9): the gather path
@pytest.mark.parametrize("index", ["host", "int32", "int64"])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("per", [1, 3])  # 3: each sequence cut into three pages (forced here)
def test_cache_batch_idx_equals_the_gathered_cache(per, num_splits, index, n_new, hk, h, dtype, monkeypatch):
    import cupy

    from cuflash import families

    chosen, select = [], families.select  # the decode tile the call runs: the bitwise reference runs it too
    monkeypatch.setattr(families, "select", lambda fam, p: chosen.append(select(fam, p)) or chosen[-1])
    if per > 1:
        monkeypatch.setattr(cache_batch, "pages_per_sequence", lambda infos: per)
    rng = np.random.default_rng(hash((per, num_splits, index, n_new, hk, h, dtype)) % 2**32)
    d, cap, pool = 128, 600, 7
    idx = np.array([5, 0, 3, 6])
    lens = np.array([0, 1, 299, cap - n_new])
    batch, nq = len(idx), max(n_new, 1)
    dt = dtype_of(dtype)
    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt)
    q, kc, vc = mk(batch, nq, h, d), mk(pool, cap, hk, d), mk(pool, cap, hk, d)
    kn, vn = (mk(batch, n_new, hk, d), mk(batch, n_new, hk, d)) if n_new else (None, None)
    k_before, v_before = kc.copy(), vc.copy()
    kg, vg = kc[cupy.asarray(idx)], vc[cupy.asarray(idx)]  # the gathered contiguous copies
    given = {"host": idx, "int32": cupy.asarray(idx, dtype=cupy.int32), "int64": cupy.asarray(idx)}[index]
    kw = dict(cache_seqlens=lens, k_new=kn, v_new=vn, causal=True, return_lse=True, num_splits=num_splits)
    out, lse = kvcache.attention_with_kvcache(q, kc, vc, cache_batch_idx=given, **kw)
    tile = chosen[-1] if chosen else None
    ref, ref_lse = kvcache.attention_with_kvcache(q, kg, vg, **kw)  # appends into the copies alike
    # the indexed sequences took the appends (the copies did too), the others are untouched
    for i in range(pool):
        where = np.flatnonzero(idx == i)
        k_want, v_want = (kg[where[0]], vg[where[0]]) if where.size else (k_before[i], v_before[i])
        assert _bits_equal(kc[i], k_want) and _bits_equal(vc[i], v_want), f"cache sequence {i}"
    gather = (h // hk) * nq > 16
    same_tile = ref
    if not gather and tile is not None:  # (the appends write the same rows again)
        mask = MaskOptions.of(causal=True)
        same_tile, _ = kvcache._forward_cupy(q, kg, vg, lens, kn, vn, mask, None, num_splits=num_splits, config=tile)
    for b, n in enumerate(lens + n_new):
        if n == 0:
            assert bool((out[b].astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse[b]).all())
            continue
        if not gather:
            assert _bits_equal(out[b], same_tile[b]), f"batch {b}: not bitwise"
        err, _, allowed = fa_rule(out[b:b + 1], q[b:b + 1], kg[b:b + 1, :n], vg[b:b + 1, :n],
                                  MaskOptions.of(causal=True), 1 / math.sqrt(d))
        assert err <= allowed, f"batch {b} (length {n}): {err:.3e} > {allowed:.3e}"
        assert float(cupy.abs(lse[b] - ref_lse[b]).max()) <= 1e-4
    if n_new == 0:  # a second call of the signature (the prepared plan, a device index's view again)
        again, _ = kvcache.attention_with_kvcache(q, kc, vc, cache_batch_idx=given, **kw)
        assert _bits_equal(again, out)


def test_repeated_indices_read_one_sequence():
    import cupy
    import ml_dtypes

    rng = np.random.default_rng(3)
    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(ml_dtypes.bfloat16)
    q, kc, vc = mk(3, 1, 16, 64), mk(4, 256, 4, 64), mk(4, 256, 4, 64)
    q[1] = q[0]
    idx = cupy.asarray([2, 2, 0], dtype=cupy.int32)
    out = kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=[200, 200, 256], cache_batch_idx=idx)
    ref = kvcache.attention_with_kvcache(q, kc[idx], vc[idx], cache_seqlens=[200, 200, 256])
    assert _bits_equal(out, ref) and _bits_equal(out[0], out[1])


def test_host_indices_out_of_range_are_refused_before_anything_runs():
    import cupy

    q = cupy.zeros((2, 1, 8, 64), dtype=cupy.float16)
    kc = cupy.zeros((3, 64, 8, 64), dtype=cupy.float16)
    kn = cupy.ones((2, 1, 8, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\] = 3 is not a sequence"):
        kvcache.attention_with_kvcache(q, kc, kc, cache_seqlens=5, k_new=kn, v_new=kn, cache_batch_idx=[0, 3])
    assert not bool(kc.any())  # nothing appended


def test_cache_batch_idx_through_torch_and_flash_attn_interface():
    torch = pytest.importorskip("torch")
    from cuflash import flash_attn_interface as fai

    g = torch.Generator(device="cuda").manual_seed(0)
    pool, b, cap, hk, h, d = 5, 3, 256, 2, 8, 64
    kc = torch.randn(pool, cap, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(pool, cap, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.tensor([4, 1, 2], device="cuda", dtype=torch.int32)
    lens = torch.tensor([0, 100, cap], device="cuda", dtype=torch.int32)
    kg, vg = kc[idx.long()], vc[idx.long()]
    out = fai.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx, causal=True)
    assert torch.equal(out, fai.flash_attn_with_kvcache(q, kg, vg, cache_seqlens=lens, causal=True))
    # without cache_seqlens: every batch sees its whole sequence (flash-attn's meaning)
    whole = fai.flash_attn_with_kvcache(q, kc, vc, cache_batch_idx=idx.cpu(), causal=True)
    assert torch.equal(whole, fai.flash_attn_with_kvcache(q, kg, vg, cache_seqlens=cap, causal=True))
