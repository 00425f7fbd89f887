"""attention_with_kvcache on the GPU (issue 17, contiguous caches; passes on the H200): per-batch cache
lengths 0, 1, random and the capacity, n_new 0, 1, 7 appended in place, GQA, causal and windows
(bottom-right aligned to each batch's length), both dtypes, head dims 64 and 128. Each batch's output
is checked by FlashAttention's 2x rule against the float64 reference on that batch's gathered
keys (cuflash.testing.fa_rule on cache[:L_b]); append-then-attend against attending to the
concatenation; outputs poisoned before the launch; rows past a length hold NaN, so a kernel that
reads them fails."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import kvcache
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule

pytestmark = pytest.mark.gpu

CAP = 300  # cache capacity: not a multiple of any key tile
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 0)), (True, (100, -1)), (False, (17, 9))]


def _lengths(kind: str, batch: int, n_new: int, rng) -> np.ndarray:
    top = CAP - n_new
    return {"zero": np.zeros(batch, np.int64), "one": np.ones(batch, np.int64),
            "max": np.full(batch, top, np.int64),
            "random": np.array([0, 1, top, *rng.integers(0, top + 1, batch - 3)], np.int64)}[kind]


def _case(rng, batch, nq, h, hk, d, dtype, lens, n_new):
    import cupy

    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    q = mk(batch, nq, h, d)
    kc, vc = mk(batch, CAP, hk, d), mk(batch, CAP, hk, d)
    for b, n in enumerate(lens):  # rows past each batch's final length: NaN, never read
        kc.view(cupy.uint16)[b, n + n_new:] = 0xFFFF  # a NaN in fp16 and bf16
        vc.view(cupy.uint16)[b, n + n_new:] = 0xFFFF
    kn = mk(batch, n_new, hk, d) if n_new else None
    vn = mk(batch, n_new, hk, d) if n_new else None
    return q, kc, vc, kn, vn


def _poisoned(q, kc, vc, lens, kn, vn, mask):
    import cupy

    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
    return kvcache._forward_cupy(q, kc, vc, lens, kn, vn, mask, None, out=out, lse=lse)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n_new", [0, 1, 7])
@pytest.mark.parametrize("lengths", ["zero", "one", "random", "max"])
@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2)])
def test_kvcache_forward(h, hk, causal, window, lengths, n_new, d, dtype):
    import cupy

    device_lengths = hk == 2  # the GQA half takes its lengths as a device array, the MHA half on the host
    rng = np.random.default_rng(hash((h, hk, causal, window, lengths, n_new, d, dtype)) % 2**32)
    batch, nq = 5, max(n_new, 1)
    lens = _lengths(lengths, batch, n_new, rng)
    if lengths == "zero" and n_new == 0:
        nq = 3  # queries that see no key at all
    q, kc, vc, kn, vn = _case(rng, batch, nq, h, hk, d, dtype_of(dtype), lens, n_new)
    kc0, vc0 = kc.copy(), vc.copy()
    mask = MaskOptions.of(causal=causal, window_size=window)
    arg = cupy.asarray(lens.astype(np.int32)) if device_lengths else lens
    out, lse = _poisoned(q, kc, vc, arg, kn, vn, mask)
    total = lens + n_new
    for b, n in enumerate(lens):  # the append wrote exactly rows n .. n + n_new, nothing else
        if n_new:
            assert bool((kc[b, n:n + n_new].view(cupy.uint16) == kn[b].view(cupy.uint16)).all())
            assert bool((vc[b, n:n + n_new].view(cupy.uint16) == vn[b].view(cupy.uint16)).all())
        for new, old in ((kc, kc0), (vc, vc0)):
            same = new[b, :n].view(cupy.uint16) == old[b, :n].view(cupy.uint16)
            assert bool(same.all())
    scale = 1 / math.sqrt(d)
    for b, n in enumerate(total):
        if n == 0:
            assert bool((out[b].astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse[b]).all())
            continue
        ob, lb = out[b:b + 1], lse[b:b + 1]
        kb, vb = kc[b:b + 1, :n], vc[b:b + 1, :n]
        assert not bool(cupy.isnan(ob.astype(cupy.float32)).any()) and not bool(cupy.isnan(lb).any())
        err, pt, allowed = fa_rule(ob, q[b:b + 1], kb, vb, mask, scale)
        assert err <= allowed, f"batch {b} (length {n}): max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_append_then_attend_equals_attention_to_the_concatenation(causal, dtype):
    """The kernel on the cache after the append sees the same keys as cuflash.attention on the
    concatenation [cache[:L_b], k_new] for each batch (same tile arithmetic: bitwise for one batch
    with the same key count, checked here by the 2x rule and bitwise where the tiles agree)."""
    import cupy
    import cuflash

    rng = np.random.default_rng(11)
    batch, h, hk, d, n_new = 3, 8, 2, 128, 7
    lens = np.array([0, 130, CAP - n_new])
    q, kc, vc, kn, vn = _case(rng, batch, n_new, h, hk, d, dtype_of(dtype), lens, n_new)
    out = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, causal=causal)
    for b, n in enumerate(lens):
        kcat = cupy.concatenate([kc[b:b + 1, :n], kn[b:b + 1]], axis=1)
        vcat = cupy.concatenate([vc[b:b + 1, :n], vn[b:b + 1]], axis=1)
        ref = cuflash.attention(q[b:b + 1], kcat, vcat, causal=causal, backend="sm80")
        diff = float(cupy.abs(out[b:b + 1].astype(cupy.float32) - ref.astype(cupy.float32)).max())
        err, pt, allowed = fa_rule(out[b:b + 1], q[b:b + 1], kcat, vcat, causal, 1 / math.sqrt(d))
        assert err <= allowed and diff <= allowed, (b, diff, err, allowed)


def test_host_lengths_that_do_not_fit_are_rejected_before_the_cache_is_written():
    import cupy

    rng = np.random.default_rng(3)
    lens = np.array([0, CAP - 2])
    q, kc, vc, kn, vn = _case(rng, 2, 3, 2, 2, 64, dtype_of("float16"), np.array([0, 0]), 3)
    before = kc.copy()
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\]"):
        kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn)
    assert bool((kc.view(cupy.uint16) == before.view(cupy.uint16)).all())


def test_device_lengths_past_the_capacity_are_clipped():
    """Device lengths are not read on the host: rows past the capacity are dropped, the attention
    covers the whole cache (documented in cuflash/kvcache.py)."""
    import cupy

    rng = np.random.default_rng(5)
    q, kc, vc, kn, vn = _case(rng, 1, 2, 2, 2, 64, dtype_of("bfloat16"), np.array([CAP - 2]), 2)
    kc[:] = cupy.asarray(rng.standard_normal(kc.shape).astype(np.float32)).astype(kc.dtype)
    vc[:] = cupy.asarray(rng.standard_normal(vc.shape).astype(np.float32)).astype(vc.dtype)
    out = kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=cupy.asarray([CAP - 1], dtype=cupy.int32),
                                         k_new=kn, v_new=vn)
    assert bool((kc[0, CAP - 1].view(cupy.uint16) == kn[0, 0].view(cupy.uint16)).all())
    err, pt, allowed = fa_rule(out, q, kc, vc, False, 1 / math.sqrt(64))
    assert err <= allowed


@pytest.mark.parametrize("num_splits", [1, 3])
def test_device_lengths_out_of_range_are_clipped_by_the_decode_kernel(num_splits):
    """The decode kernel takes device lengths as given and clips length + n_new into [0, capacity]
    itself (FwdParams.seqused_add): negative lengths see no key (out 0, lse -inf), lengths up to
    int32's maximum see the whole cache; the rows in range are exact."""
    import cupy

    rng = np.random.default_rng(8)
    lens = np.array([-5, -(2**31), 2**31 - 1, CAP + 9, 100], np.int64)
    q, kc, vc, _, _ = _case(rng, 5, 1, 8, 2, 128, dtype_of("bfloat16"), np.clip(lens, 0, CAP), 0)
    got, lse = kvcache._forward_cupy(q, kc, vc, cupy.asarray(lens.astype(np.int32)), None, None, MaskOptions.of(),
                                     None, num_splits=num_splits)
    assert bool((got[:2].astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse[:2]).all())
    for b, n in ((2, CAP), (3, CAP), (4, 100)):
        err, _, allowed = fa_rule(got[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], False, 1 / math.sqrt(128))
        assert err <= allowed, (b, err, allowed)


def test_torch_path_writes_the_cache_in_place():
    torch = pytest.importorskip("torch")
    import cuflash

    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)
    q, kc, vc, kn, vn = mk(2, 1, 8, 128), mk(2, 64, 2, 128), mk(2, 64, 2, 128), mk(2, 1, 2, 128), mk(2, 1, 2, 128)
    lens = torch.tensor([5, 63], dtype=torch.int32, device="cuda")
    out, lse = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and lse.shape == (2, 8, 1)
    assert torch.equal(kc[0, 5], kn[0, 0]) and torch.equal(vc[1, 63], vn[1, 0])
    for b, n in enumerate((6, 64)):
        ref = cuflash.attention(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n])
        assert torch.allclose(out[b:b + 1].float(), ref.float(), atol=2e-2)


def test_flash_attn_interface_with_kvcache_matches():
    torch = pytest.importorskip("torch")
    import cuflash
    from cuflash import flash_attn_interface as fai

    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.float16)
    q, kn, vn = mk(3, 4, 8, 64), mk(3, 4, 2, 64), mk(3, 4, 2, 64)
    kc, vc = mk(3, 100, 2, 64), mk(3, 100, 2, 64)
    kc2, vc2 = kc.clone(), vc.clone()
    lens = torch.tensor([0, 50, 96], dtype=torch.int32, device="cuda")
    out, lse = fai.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, causal=True,
                                           return_softmax_lse=True)
    out2, lse2 = cuflash.attention_with_kvcache(q, kc2, vc2, cache_seqlens=lens.cpu(), k_new=kn, v_new=vn,
                                                causal=True, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (100, -1))])
@pytest.mark.parametrize("num_splits", [0, 2, 3, 7, 64])
def test_split_kv_equals_no_split(num_splits, causal, window, d, dtype):
    """Split-KV decoding (one new token and a short chunk; GQA 32/8 heads' ratio at 8/2) against
    the unsplit kernel and the float64 reference per batch (FlashAttention's 2x rule); the splits
    past a batch's length contribute nothing."""
    import cupy

    rng = np.random.default_rng(hash((num_splits, causal, window, d, dtype, "split")) % 2**32)
    batch, h, hk = 4, 8, 2
    lens = np.array([0, 1, 150, CAP - 7])
    for n_new in (1, 7):
        q, kc, vc, kn, vn = _case(rng, batch, n_new, h, hk, d, dtype_of(dtype), lens, n_new)
        kc2, vc2 = kc.copy(), vc.copy()
        kw = dict(cache_seqlens=lens, causal=causal, window_size=window, return_lse=True)
        out, lse = kvcache.attention_with_kvcache(q, kc, vc, k_new=kn, v_new=vn, num_splits=num_splits, **kw)
        ref_out, ref_lse = kvcache.attention_with_kvcache(q, kc2, vc2, k_new=kn, v_new=vn, num_splits=1, **kw)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (batch, h, n_new)
        mask = MaskOptions.of(causal=causal, window_size=window)
        for b, n in enumerate(lens + n_new):
            kb, vb = kc[b:b + 1, :n], vc[b:b + 1, :n]
            err, pt, allowed = fa_rule(out[b:b + 1], q[b:b + 1], kb, vb, mask, 1 / math.sqrt(d))
            assert err <= allowed, f"batch {b}: {err:.3e} > {allowed:.3e}"
            diff = float(cupy.abs(out[b].astype(cupy.float32) - ref_out[b].astype(cupy.float32)).max())
            assert diff <= allowed, f"batch {b}: split and unsplit differ by {diff:.3e} > {allowed:.3e}"
            assert float(cupy.abs(lse[b] - ref_lse[b]).max()) <= 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rotary_fraction", [1, 2])  # rotary_dim = head_dim / fraction
def test_rotary_kvcache_matches_the_reference(rotary_fraction, causal, interleaved, dtype):
    """k_new is rotated at cache_seqlens + t before the append (the cache rows equal the reference
    rotation rounded to the dtype, to one unit in the last place), q at cache_seqlens + i (causal)
    or cache_seqlens (not), and the output passes the 2x rule against attention of the reference-
    rotated q to the cache."""
    import cupy

    from cuflash import reference

    rng = np.random.default_rng(hash((rotary_fraction, causal, interleaved, dtype, "rotary")) % 2**32)
    batch, h, hk, d, n_new = 3, 8, 2, 128, 5
    lens = np.array([0, 17, CAP - n_new])
    dt = dtype_of(dtype)
    q, kc, vc, kn, vn = _case(rng, batch, n_new, h, hk, d, dt, lens, n_new)
    half = d // rotary_fraction // 2
    theta = rng.uniform(0, 6.3, (CAP + 4, half))
    cos, sin = cupy.asarray(np.cos(theta).astype(np.float32)), cupy.asarray(np.sin(theta).astype(np.float32))
    out = kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, causal=causal,
                                         rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    t = np.arange(n_new)[None]
    k_ref = reference.rotary(cupy.asnumpy(kn.astype(cupy.float32)), cos.get(), sin.get(), lens[:, None] + t,
                             interleaved=interleaved)
    q_pos = lens[:, None] + (t if causal else 0 * t)
    q_ref = reference.rotary(cupy.asnumpy(q.astype(cupy.float32)), cos.get(), sin.get(), q_pos, interleaved=interleaved)
    for b, n in enumerate(lens):
        got = cupy.asnumpy(kc[b, n:n + n_new].astype(cupy.float32)).astype(np.float64)
        ulp = np.abs(k_ref[b]) * (2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10) + 1e-6
        assert (np.abs(got - k_ref[b]) <= ulp).all(), f"batch {b}: appended rows are not the rotated k_new"
    # q as the path rotates it (cuflash.rotary, float32 then rounded): within an ulp of the reference,
    # and the output is attention of exactly that q (the 2x rule)
    from cuflash import rotary

    qr = rotary.apply(q, cos, sin, cupy.asarray(q_pos), interleaved)
    got = cupy.asnumpy(qr.astype(cupy.float32)).astype(np.float64)
    ulp = np.abs(q_ref) * (2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10) + 1e-6
    assert (np.abs(got - q_ref) <= ulp).all(), "q's rotation is not the reference's"
    mask = MaskOptions.of(causal=causal)
    for b, n in enumerate(lens + n_new):
        err, pt, allowed = fa_rule(out[b:b + 1], qr[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], mask, 1 / math.sqrt(d))
        assert err <= allowed, f"batch {b}: {err:.3e} > {allowed:.3e}"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_repeated_calls_take_the_prepared_call_and_still_check_lengths(num_splits):
    """The fast path (kvcache._call_key / _Prepared): a second call of one signature reuses the
    first's resolved plan, gives bitwise the same result for the same inputs (int, host and device
    lengths; split results combined straight into the output dtype), follows new lengths, and
    still rejects host lengths that do not fit before the cache is written."""
    import cupy

    rng = np.random.default_rng(11)
    mask = MaskOptions.of(causal=True)
    q, kc, vc, _, _ = _case(rng, 3, 1, 8, 2, 128, dtype_of("bfloat16"), np.array([CAP] * 3), 0)
    kc[:] = cupy.asarray(rng.standard_normal(kc.shape).astype(np.float32)).astype(kc.dtype)
    vc[:] = cupy.asarray(rng.standard_normal(vc.shape).astype(np.float32)).astype(vc.dtype)
    kvcache._plans.clear()
    for lens in (200, [5, 200, CAP], cupy.asarray([5, 200, CAP], dtype=cupy.int32)):
        call = lambda: kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,  # noqa: E731
                                                      num_splits=num_splits, return_lse=True)
        key = kvcache._call_key(q, kc, vc, lens, None, None, None, mask, None, num_splits)
        first = call()
        assert kvcache._plans.lookup(key) is not None
        again = call()
        for a, b in zip(first, again):
            assert bool((a.view(cupy.uint8) == b.view(cupy.uint8)).all()) if a.dtype != cupy.float32 else \
                bool(cupy.array_equal(a, b, equal_nan=True))
        host = [lens] * 3 if isinstance(lens, int) else cupy.asnumpy(cupy.asarray(lens)).tolist()
        for b, n in enumerate(host):  # against the reference on each batch's keys
            err, pt, allowed = fa_rule(again[0][b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], True,
                                       1 / math.sqrt(128))
            assert err <= allowed, (lens, b, err, allowed)
    before = kc.copy()
    kn = vn = cupy.zeros((3, 2, 2, 128), dtype=kc.dtype)
    for lens in (0, [0, 1, 2]):  # both kinds of host lengths prepared, then
        kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn)
    kc[:] = before
    for bad in (CAP - 1, [0, CAP - 1, 0]):
        with pytest.raises(ValueError, match=r"cache_seqlens\[\d\] = 299"):
            kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=bad, k_new=kn, v_new=vn)
    assert bool((kc.view(cupy.uint16) == before.view(cupy.uint16)).all())


def test_one_int_length_is_staged_once_per_stream():
    """cache_seqlens as one int (kvcache._uniform_lengths): the second call on a stream reads the
    first call's staged arrays (no upload per call); another stream or another length stages its
    own; the results follow the lengths (against the reference on each batch's keys)."""
    import cupy

    rng = np.random.default_rng(12)
    q, kc, vc, _, _ = _case(rng, 2, 1, 8, 2, 64, dtype_of("float16"), np.array([CAP] * 2), 0)
    kvcache._UNIFORM_LENGTHS.clear()
    a = kvcache._uniform_lengths(2, 100, 0, 0)
    assert kvcache._uniform_lengths(2, 100, 0, 0)[0].data.ptr == a[0].data.ptr
    assert kvcache._uniform_lengths(2, 101, 0, 0)[0].data.ptr != a[0].data.ptr
    lens, seqused = kvcache._uniform_lengths(2, 100, 3, 0)
    assert cupy.asnumpy(lens).tolist() == [100, 100] and cupy.asnumpy(seqused).tolist() == [103, 103]
    with cupy.cuda.Stream(non_blocking=True):
        assert kvcache._uniform_lengths(2, 100, 0, 0)[0].data.ptr != a[0].data.ptr
    for n in (100, 37, 100, CAP):
        out = kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=n)
        for b in range(2):
            err, pt, allowed = fa_rule(out[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], False,
                                       1 / math.sqrt(64))
            assert err <= allowed, (n, b, err, allowed)
    assert len(kvcache._UNIFORM_LENGTHS) <= kvcache._UNIFORM_LENGTHS_MAX
