"""cuflash.merge_attention on NumPy (the path CuPy and torch share, with their own array module):
merging the (out, lse) of attention over parts of the keys gives attention over all of them."""
from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.merge import merge_attention


def _attn(q, k, v, allowed=None):
    """float64 attention (b, n, h, d) with an explicit (nq, nk) boolean mask; (out, lse)."""
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    m = s.max(-1, initial=-np.inf)
    fm = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - fm[..., None])
    l = e.sum(-1)
    p = np.where(l[..., None] > 0, e / np.where(l > 0, l, 1)[..., None], 0.0)
    lse = np.where(l > 0, fm + np.log(np.where(l > 0, l, 1)), -np.inf)
    return np.einsum("bhqk,bkhd->bqhd", p, v), lse


def _qkv(rng, b, nq, nk, h, d):
    return rng.standard_normal((b, nq, h, d)), rng.standard_normal((b, nk, h, d)), rng.standard_normal((b, nk, h, d))


@pytest.mark.parametrize("cuts", [(), (37,), (1, 2, 90), (0, 50), (100,)])
@pytest.mark.parametrize("causal", [False, True])
def test_merging_key_parts_gives_attention_over_all_keys(cuts, causal):
    rng = np.random.default_rng(len(cuts) * 2 + causal)
    b, nq, nk, h, d = 2, 70, 100, 3, 16
    q, k, v = _qkv(rng, b, nq, nk, h, d)
    rows, cols = np.arange(nq)[:, None], np.arange(nk)[None, :]
    allowed = cols <= rows + (nk - nq) if causal else np.ones((nq, nk), bool)  # bottom-right causal
    want_out, want_lse = _attn(q, k, v, allowed)
    edges = [0, *cuts, nk]
    parts = [_attn(q, k[:, a:e], v[:, a:e], allowed[:, a:e]) for a, e in zip(edges, edges[1:])]
    out, lse = merge_attention([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_rows_no_part_attended_are_zero_with_lse_minus_inf():
    rng = np.random.default_rng(0)
    o = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    lse = np.full((1, 2, 4), -np.inf, np.float32)
    lse2 = lse.copy()
    lse2[0, 1, 2] = 0.5
    out, l = merge_attention([o, 2 * o], [lse, lse2])
    assert np.isneginf(l).sum() == 7 and l[0, 1, 2] == np.float32(0.5)
    assert (out[0, 2, 1] == 2 * o[0, 2, 1]).all()
    mask = np.ones(out.shape, bool)
    mask[0, 2, 1] = False
    assert (out[mask] == 0).all()


def test_nan_in_a_part_propagates_to_its_row_only():
    o = np.ones((1, 3, 1, 4), np.float32)
    lse = np.zeros((1, 1, 3), np.float32)
    bad = lse.copy()
    bad[0, 0, 1] = np.nan
    out, l = merge_attention([o, o], [lse, bad])
    assert np.isnan(l[0, 0, 1]) and np.isnan(out[0, 1]).all()
    assert np.isfinite(l[0, 0, [0, 2]]).all() and np.isfinite(out[0, [0, 2]]).all()


def test_dtypes_and_large_lses():
    o = np.ones((1, 2, 1, 8), np.float16)
    lse = np.full((1, 1, 2), 1e4, np.float32)  # exp would overflow without the running maximum
    out, l = merge_attention([o, o], [lse, lse])
    assert out.dtype == np.float16 and l.dtype == np.float32
    np.testing.assert_allclose(out, 1.0)
    np.testing.assert_allclose(l, 1e4 + np.log(2), rtol=1e-6)
    assert merge_attention([o], [lse], out_dtype=np.float32)[0].dtype == np.float32
    assert merge_attention([o.astype(np.float64)], [lse.astype(np.float64)])[1].dtype == np.float64


@pytest.mark.parametrize("outs, lses, exc, words", [
    ([], [], ValueError, "at least one"),
    ([np.zeros((1, 2, 1, 8))], [], ValueError, "one entry per part"),
    ([np.zeros((1, 2, 1, 8))], [np.zeros((1, 2, 1))], ValueError, r"lses\[0\] must have shape"),
    ([np.zeros((2, 1, 8))], [np.zeros((1, 2))], ValueError, "4 dimensions"),
    ([np.zeros((1, 2, 1, 8)), np.zeros((1, 3, 1, 8))], [np.zeros((1, 1, 2))] * 2, ValueError, r"outs\[1\] has shape"),
    ([np.zeros((1, 2, 1, 8))], [np.zeros((1, 1, 2), np.int32)], TypeError, "floating-point"),
    ([[[1.0]]], [np.zeros(1)], TypeError, "NumPy, CuPy or torch"),
    ("ab", "ab", TypeError, "sequences of arrays"),
])
def test_bad_arguments_name_what_is_wrong(outs, lses, exc, words):
    with pytest.raises(exc, match=words):
        merge_attention(outs, lses)


def test_public_name():
    assert cuflash.merge_attention is merge_attention and "merge_attention" in cuflash.__all__
