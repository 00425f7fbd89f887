"""cache_leftpad (attention_with_kvcache / flash_attn_with_kvcache, FlashAttention's argument): batch
b attends to rows cache_leftpad[b] .. cache_seqlens[b] + n_new of its cache, appends at
cache_seqlens[b], and rotates at positions counted from row 0. It runs as a paged cache of one-row
pages (cuflash/cache_leftpad.py), so each batch's result must meet FlashAttention's rule against the
float64 reference over exactly those rows (masks aligned to the last key), its lse agree with the
same call on a copy of the rows from the pad on, and the appends land at cache_seqlens. Layouts:
contiguous, Hugging Face's transposed cache, cache_batch_idx, pages; host and device pads; the
decode kernel, split-KV and the gather path (more rows per K/V head than the decode tile); rotary;
torch through flash_attn_with_kvcache."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import kvcache, rotary
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule

pytestmark = pytest.mark.gpu


def _bits_equal(a, b) -> bool:
    import cupy

    return bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


def _caches(rng, layout, batch, cap, hk, d, dt):
    """(k_cache, v_cache as the call takes them, block_table or None, cache_batch_idx or None, a
    function giving batch b's (cap, hk, d) sequence of either cache)."""
    import cupy

    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt)
    if layout == "transposed":  # Hugging Face's (batch, heads, seq, dim), seen as (batch, seq, heads, dim)
        k, v = (mk(batch, hk, cap, d).transpose(0, 2, 1, 3) for _ in range(2))
        return k, v, None, None, lambda c, b: c[b]
    if layout == "index":
        idx = np.array([4, 0, 2, 5][:batch])
        k, v = mk(6, cap, hk, d), mk(6, cap, hk, d)
        return k, v, None, idx, lambda c, b: c[idx[b]]
    if layout == "paged":
        page = 16
        per = cap // page
        table = rng.permutation(batch * per + 3)[:batch * per].reshape(batch, per).astype(np.int32)
        k, v = mk(batch * per + 3, page, hk, d), mk(batch * per + 3, page, hk, d)
        return k, v, cupy.asarray(table), None, lambda c, b: c[cupy.asarray(table[b])].reshape(cap, hk, d)
    k, v = mk(batch, cap, hk, d), mk(batch, cap, hk, d)
    return k, v, None, None, lambda c, b: c[b]


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "index", "paged"])
@pytest.mark.parametrize("h,hk,n_new", [(32, 8, 1), (8, 8, 0), (8, 2, 9)])  # (8, 2, 9): the gather path
@pytest.mark.parametrize("pads_on", ["host", "device"])
@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("window", [(-1, 0), (37, 0)])
def test_left_padded_rows_against_the_reference(window, num_splits, pads_on, n_new, hk, h, layout):
    import cupy

    rng = np.random.default_rng(hash((window, num_splits, pads_on, n_new, hk, h, layout)) % 2**32)
    d, cap, batch = 128, 256, 4
    dt = dtype_of("bfloat16")
    kc, vc, table, idx, seq = _caches(rng, layout, batch, cap, hk, d, dt)
    lens = np.array([0, 1, 130, cap - n_new])
    pads = np.array([0, 1, 57, 200])
    nq = max(n_new, 1)
    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt)
    q = mk(batch, nq, h, d)
    kn, vn = (mk(batch, n_new, hk, d), mk(batch, n_new, hk, d)) if n_new else (None, None)
    before = [(seq(kc, b).copy(), seq(vc, b).copy()) for b in range(batch)]
    mask = MaskOptions.of(causal=True, window_size=window)
    given = pads if pads_on == "host" else cupy.asarray(pads, dtype=cupy.int32)
    out, lse = kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, causal=True,
                                              window_size=window, return_lse=True, num_splits=num_splits,
                                              block_table=table, cache_batch_idx=idx, cache_leftpad=given)
    for b in range(batch):
        k_b, v_b = seq(kc, b), seq(vc, b)
        k_want, v_want = before[b]
        if n_new:  # the appends at cache_seqlens, nothing else written
            k_want[lens[b]:lens[b] + n_new], v_want[lens[b]:lens[b] + n_new] = kn[b], vn[b]
        assert _bits_equal(k_b, k_want) and _bits_equal(v_b, v_want), f"batch {b}: the cache"
        lo, hi = pads[b], lens[b] + n_new
        if hi == lo:
            assert bool((out[b].astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse[b]).all())
            continue
        kr, vr = k_b[None, lo:hi].copy(), v_b[None, lo:hi].copy()
        err, _, allowed = fa_rule(out[b:b + 1], q[b:b + 1], kr, vr, mask, 1 / math.sqrt(d))
        assert err <= allowed, f"batch {b} (rows {lo}..{hi}): {err:.3e} > {allowed:.3e}"
        # the same call on a contiguous copy of those rows (nothing to append: they hold the new rows)
        _, ref_lse = kvcache.attention_with_kvcache(q[b:b + 1], kr, vr, cache_seqlens=hi - lo, causal=True,
                                                    window_size=window, return_lse=True)
        assert float(cupy.abs(lse[b] - ref_lse[0]).max()) <= 1e-3, f"batch {b}: lse"


@pytest.mark.parametrize("pads", [[2, 99, 0], None])  # None: a block table alone (rotary's own paged case)
@pytest.mark.parametrize("per_token", [False, True])
def test_rotary_positions_count_from_row_zero(per_token, pads):
    """q and k_new are rotated at cache_seqlens[b] + t (not cache_seqlens - pad): the call equals the
    one without rotary on q and k_new rotated at those positions, bitwise. Both run the paged path
    (one-row pages; or 16-row pages through a block table), which rotary once lost (its problem
    re-resolved without the paged fields read the pages as batches)."""
    import cupy

    rng = np.random.default_rng(7 + per_token)
    b, cap, h, hk, d, n_new = 3, 192, 8, 2, 64, 2
    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(cupy.float16)
    q, kn, vn = mk(b, 2, h, d), mk(b, n_new, hk, d), mk(b, n_new, hk, d)
    kc, vc = mk(b, cap, hk, d), mk(b, cap, hk, d)
    k2, v2 = kc.copy(), vc.copy()
    angle = rng.uniform(0, 2 * np.pi, (cap, d // 4)).astype(np.float32)
    cos, sin = cupy.asarray(np.cos(angle)), cupy.asarray(np.sin(angle))
    lens = np.array([5, 100, 150])
    causal = per_token
    extra = dict(cache_leftpad=pads)
    if pads is None:  # the caches as 16-row pages in a shuffled order
        order = rng.permutation(b * cap // 16)
        table = cupy.asarray(np.argsort(order).reshape(b, cap // 16).astype(np.int32))
        kc, vc = (c.reshape(-1, 16, hk, d)[cupy.asarray(order)].copy() for c in (kc, vc))
        k2, v2 = kc.copy(), vc.copy()
        extra = dict(block_table=table)
    out = kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, causal=causal,
                                         rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False, **extra)
    lens_dev = cupy.asarray(lens, dtype=cupy.int32)
    qr = rotary.apply(q, cos, sin, rotary.positions(lens_dev, 2, per_token), False)
    knr = rotary.apply(kn, cos, sin, rotary.positions(lens_dev, n_new, True), False)
    ref = kvcache.attention_with_kvcache(qr, k2, v2, cache_seqlens=lens, k_new=knr, v_new=vn, causal=causal,
                                         **extra)
    assert _bits_equal(out, ref)
    assert _bits_equal(kc, k2) and _bits_equal(vc, v2)


def test_host_pad_past_its_length_is_refused_before_anything_runs():
    import cupy

    q = cupy.zeros((2, 1, 8, 64), dtype=cupy.float16)
    kc = cupy.zeros((2, 64, 8, 64), dtype=cupy.float16)
    kn = cupy.ones((2, 1, 8, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match=r"cache_leftpad\[1\] = 9 is past cache_seqlens\[1\] = 5"):
        kvcache.attention_with_kvcache(q, kc, kc, cache_seqlens=5, k_new=kn, v_new=kn, cache_leftpad=[0, 9])
    assert not bool(kc.any())  # nothing appended


def test_hugging_face_cache_through_torch_and_flash_attn_interface():
    """A left-padded batch decoding over a (batch, heads, seq, dim) torch cache transposed, with
    device pads: the result of attention over each batch's rows from its pad (float32 SDPA)."""
    torch = pytest.importorskip("torch")
    from cuflash import flash_attn_interface as fai

    g = torch.Generator(device="cuda").manual_seed(0)
    b, hk, h, s, d = 3, 2, 8, 300, 64
    k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    pads = torch.tensor([0, 17, 250], device="cuda", dtype=torch.int32)
    out = fai.flash_attn_with_kvcache(q, k.transpose(1, 2), v.transpose(1, 2), cache_leftpad=pads, causal=True)
    for i in range(b):
        p = int(pads[i])
        kr = k[i:i + 1, :, p:].float().repeat_interleave(h // hk, dim=1)
        vr = v[i:i + 1, :, p:].float().repeat_interleave(h // hk, dim=1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[i:i + 1].transpose(1, 2).float(), kr, vr)
        assert (out[i:i + 1].float() - ref.transpose(1, 2)).abs().max().item() < 2e-2, f"batch {i}"
