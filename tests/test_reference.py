"""Self-tests of the float64 NumPy oracle (cuflash.reference). CPU only, no CuPy needed."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash.reference import (
    attention_backward,
    attention_backward_tiled,
    attention_naive,
    attention_v1_tiled,
    attention_v2_tiled,
    causal_mask,
    repeat_kv,
    sum_groups,
)

TILED = [attention_v1_tiled, attention_v2_tiled]
TOL = dict(rtol=1e-12, atol=1e-12)

# (B, H, Nq, Nk, D, block_q, block_k): odd seqlens, Nq != Nk both ways, blocks that do not
# divide the seqlens, blocks larger than the seqlens, and Nq > Nk (fully masked causal rows).
SHAPES = [
    (1, 1, 1, 1, 16, 64, 64),
    (2, 3, 7, 17, 16, 4, 5),
    (2, 2, 17, 7, 64, 5, 3),
    (1, 2, 113, 130, 64, 32, 48),
    (2, 1, 130, 113, 16, 48, 32),
    (1, 2, 130, 7, 16, 16, 4),
    (1, 1, 1, 113, 64, 64, 16),
]


def _qkv(seed, b, h, nq, nk, d, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, nq, h, d)).astype(dtype)
    k = rng.standard_normal((b, nk, h, d)).astype(dtype)
    v = rng.standard_normal((b, nk, h, d)).astype(dtype)
    return q, k, v


def _dropout(seed, b, h, nq, nk, p):
    return np.random.default_rng(seed).random((b, h, nq, nk)) >= p


def _assert_lse_equal(lse, ref):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(lse[finite], ref[finite], **TOL)


def _assert_forward_matches_naive(fwd, q, k, v, **kw):
    out_ref, lse_ref = attention_naive(q, k, v, **{n: x for n, x in kw.items() if not n.startswith("block")})
    out, lse = fwd(q, k, v, **kw)
    assert out.dtype == lse.dtype == np.float64
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, out_ref, **TOL)
    _assert_lse_equal(lse, lse_ref)
    return out, lse


# --------------------------------------------------------------------------- mask and naive


def test_causal_mask_bottom_right():
    np.testing.assert_array_equal(causal_mask(4, 4), np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(causal_mask(2, 4), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(causal_mask(4, 2), [[0, 0], [0, 0], [1, 0], [1, 1]])


def test_naive_matches_explicit_softmax():
    q, k, v = _qkv(0, 2, 3, 5, 9, 16)
    s = np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(16)
    p = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    out, lse = attention_naive(q, k, v)
    np.testing.assert_allclose(out, np.einsum("bhij,bjhd->bihd", p, v), **TOL)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), **TOL)
    mask = _dropout(4, 2, 3, 5, 9, 0.4)
    out, lse_drop = attention_naive(q, k, v, dropout_mask=mask, dropout_p=0.4)
    np.testing.assert_allclose(out, np.einsum("bhij,bjhd->bihd", p * mask / 0.6, v), **TOL)
    np.testing.assert_allclose(lse_drop, lse, **TOL)


def test_naive_causal_edge_rows():
    nq, nk = 6, 4
    q, k, v = _qkv(1, 2, 2, nq, nk, 16)
    out, lse = attention_naive(q, k, v, causal=True)
    # Rows 0, 1 see no key: exactly 0 and -inf. Row 2 sees only key 0: O = V_0, L = S_00.
    assert (out[:, :2] == 0).all() and np.isneginf(lse[:, :, :2]).all()
    np.testing.assert_allclose(out[:, 2], v[:, 0], **TOL)
    np.testing.assert_allclose(lse[:, :, 2], np.einsum("bhd,bhd->bh", q[:, 2], k[:, 0]) / 4.0, **TOL)
    assert np.isfinite(lse[:, :, 2:]).all()


# --------------------------------------------------------------------------- tiled forward


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fwd", TILED)
def test_tiled_forward_matches_naive(fwd, shape, causal):
    b, h, nq, nk, d, bq, bk = shape
    q, k, v = _qkv(SHAPES.index(shape), b, h, nq, nk, d)
    out, lse = _assert_forward_matches_naive(fwd, q, k, v, causal=causal, block_q=bq, block_k=bk)
    if causal and nq > nk:
        assert (out[:, : nq - nk] == 0).all() and np.isneginf(lse[:, :, : nq - nk]).all()


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 2),
    nq=st.integers(1, 40),
    nk=st.integers(1, 40),
    d=st.sampled_from([16, 64]),
    block_q=st.integers(1, 48),
    block_k=st.integers(1, 48),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_tiled_forward_matches_naive_hypothesis(b, h, nq, nk, d, block_q, block_k, causal, seed):
    q, k, v = _qkv(seed, b, h, nq, nk, d)
    for fwd in TILED:
        _assert_forward_matches_naive(fwd, q, k, v, causal=causal, block_q=block_q, block_k=block_k)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fwd", TILED)
def test_tiled_forward_dropout_matches_naive(fwd, causal):
    b, h, nq, nk, d, p = 2, 2, 37, 23, 16, 0.3
    q, k, v = _qkv(2, b, h, nq, nk, d)
    mask = _dropout(3, b, h, nq, nk, p)
    out, lse = _assert_forward_matches_naive(
        fwd, q, k, v, causal=causal, block_q=8, block_k=5, dropout_mask=mask, dropout_p=p
    )
    out_nodrop, lse_nodrop = attention_naive(q, k, v, causal=causal)
    assert not np.allclose(out, out_nodrop)  # the mask is really applied ...
    _assert_lse_equal(lse, lse_nodrop)  # ... but L is that of the undropped softmax


# --------------------------------------------------------------------------- backward


def _finite_difference_check(seed, b, h, nq, nk, d, causal, p, scale=None, n_entries=4, eps=1e-5):
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(seed, b, h, nq, nk, d)
    dout = rng.standard_normal(q.shape)
    kw = dict(causal=causal, softmax_scale=scale)
    if p:
        kw.update(dropout_mask=_dropout(seed + 1, b, h, nq, nk, p), dropout_p=p)

    def loss(q, k, v):
        return (attention_naive(q, k, v, **kw)[0] * dout).sum()

    out, lse = attention_naive(q, k, v, **kw)
    grads = attention_backward(dout, q, k, v, out, lse, **kw)
    args = [q, k, v]
    for which, grad in enumerate(grads):
        x = args[which]
        idx = [tuple(rng.integers(0, n) for n in x.shape) for _ in range(n_entries)]
        numeric = []
        for i in idx:
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[which][i] += eps
            minus[which][i] -= eps
            numeric.append((loss(*plus) - loss(*minus)) / (2 * eps))
        analytic = np.array([grad[i] for i in idx])
        err = np.linalg.norm(analytic - numeric) / max(np.linalg.norm(numeric), 1e-3)
        assert err < 1e-6, ("dq", "dk", "dv")[which]


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(9, 14), (14, 9)])
def test_backward_matches_finite_differences(nq, nk, causal, p):
    _finite_difference_check(nq * 100 + nk, 2, 2, nq, nk, 16, causal, p)


def test_backward_finite_differences_custom_scale():
    _finite_difference_check(7, 1, 2, 11, 6, 16, causal=True, p=0.0, scale=0.37)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_tiled_matches_backward(shape, causal):
    b, h, nq, nk, d, bq, bk = shape
    q, k, v = _qkv(SHAPES.index(shape) + 100, b, h, nq, nk, d)
    dout = np.random.default_rng(5).standard_normal(q.shape)
    out, lse = attention_naive(q, k, v, causal=causal)
    ref = attention_backward(dout, q, k, v, out, lse, causal=causal)
    got = attention_backward_tiled(dout, q, k, v, out, lse, causal=causal, block_q=bq, block_k=bk)
    for g, r in zip(got, ref):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, r, **TOL)
    if causal and nq > nk:  # rows that attend nothing get no gradient
        assert (got[0][:, : nq - nk] == 0).all()


# --------------------------------------------------------------------------- scale and dtypes


@pytest.mark.parametrize("fwd", [attention_naive, *TILED])
def test_softmax_scale_is_honoured(fwd):
    d, scale = 16, 0.9
    q, k, v = _qkv(8, 1, 2, 13, 10, d)
    out, lse = fwd(q, k, v, causal=True, softmax_scale=scale)
    # tau Q K^T with tau = 0.9 is the default 1/sqrt(d) applied to (0.9 sqrt(d)) Q.
    out_ref, lse_ref = attention_naive(q * scale * math.sqrt(d), k, v, causal=True)
    np.testing.assert_allclose(out, out_ref, **TOL)
    _assert_lse_equal(lse, lse_ref)
    assert not np.allclose(out, fwd(q, k, v, causal=True)[0])


def test_backward_tiled_softmax_scale():
    q, k, v = _qkv(9, 1, 2, 13, 10, 16)
    dout = np.random.default_rng(10).standard_normal(q.shape)
    out, lse = attention_naive(q, k, v, softmax_scale=0.2)
    ref = attention_backward(dout, q, k, v, out, lse, softmax_scale=0.2)
    got = attention_backward_tiled(dout, q, k, v, out, lse, softmax_scale=0.2, block_q=4, block_k=3)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, **TOL)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_inputs_are_upcast(dtype):
    q, k, v = _qkv(11, 1, 2, 9, 12, 16, dtype=dtype)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    out_ref, lse_ref = attention_naive(q64, k64, v64, causal=True)
    for fwd in [attention_naive, *TILED]:
        out, lse = fwd(q, k, v, causal=True)
        assert out.dtype == lse.dtype == np.float64
        np.testing.assert_allclose(out, out_ref, **TOL)
        _assert_lse_equal(lse, lse_ref)
    dout = np.random.default_rng(12).standard_normal(q.shape).astype(dtype)
    ref = attention_backward(dout.astype(np.float64), q64, k64, v64, out_ref, lse_ref, causal=True)
    for bwd in [attention_backward, attention_backward_tiled]:
        got = bwd(dout, q, k, v, out_ref, lse_ref, causal=True)
        for g, r in zip(got, ref):
            assert g.dtype == np.float64
            np.testing.assert_allclose(g, r, **TOL)


def test_invalid_arguments_raise():
    q, k, v = _qkv(13, 1, 1, 4, 5, 16)
    with pytest.raises(ValueError):
        attention_naive(q, k[:, :, :, :8], v)
    with pytest.raises(ValueError):
        attention_naive(q, k, v, dropout_p=0.1)  # dropout needs an explicit mask
    with pytest.raises(ValueError):
        attention_v2_tiled(q, k, v, dropout_mask=np.ones((1, 1, 5, 4), bool), dropout_p=0.1)


# --------------------------------------------------------------------------- NaN and Inf


def _visible_rows(nq, nk, causal, key):
    """Rows that see key `key` (all rows without a mask)."""
    return causal_mask(nq, nk)[:, key] if causal else np.ones(nq, bool)


def _sdpa_like(q, k, v, causal):
    """softmax(tau Q K^T + mask) V written as PyTorch's math SDPA computes it (no -inf guards but
    PyTorch 2.5's fully-masked rows -> 0), for the NaN pattern."""
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = np.where(causal_mask(*s.shape[-2:]), s, -np.inf)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    p = np.where(np.isneginf(s).all(axis=-1, keepdims=True), 0.0, p)
    return (p @ v).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_propagate_like_pytorch(causal, where, bad):
    b, h, nq, nk, d = 2, 2, 9, 13, 16
    q, k, v = _qkv(5, b, h, nq, nk, d)
    pos = 6
    {"q": q, "k": k, "v": v}[where][1, pos, 0, 3] = bad
    with np.errstate(invalid="ignore", over="ignore"):
        out, lse = attention_naive(q, k, v, causal=causal)
        like = _sdpa_like(q, k, v, causal)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(like))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(like))
    # only (batch 1, head 0) is touched
    others = np.ones((b, h), bool)
    others[1, 0] = False
    assert np.isfinite(out.transpose(0, 2, 1, 3)[others]).all() and np.isfinite(lse[others]).all()
    rows = np.isnan(out[1, :, 0]).any(axis=-1)
    if where != "v":  # a NaN score: the row and its lse are NaN
        np.testing.assert_array_equal(np.isnan(lse[1, 0]), rows)
    if where == "k" and np.isnan(bad):  # exactly the rows that see that key
        np.testing.assert_array_equal(rows, _visible_rows(nq, nk, causal, pos))
    if where == "q" and np.isnan(bad):  # exactly that query's row
        assert rows.tolist() == [i == pos for i in range(nq)]


def test_nan_row_is_nan_not_zero():
    """The bug this replaces: a NaN row came out as 0 with lse -inf (l > 0 is False for NaN)."""
    q, k, v = _qkv(1, 1, 1, 4, 4, 16)
    q[0, 2, 0, 0] = np.nan
    for fwd in (attention_naive, attention_v1_tiled, attention_v2_tiled):
        out, lse = fwd(q, k, v)
        assert np.isnan(out[0, 2, 0]).all() and np.isnan(lse[0, 0, 2])
        assert np.isfinite(np.delete(out[0, :, 0], 2, axis=0)).all()


def test_all_minus_inf_row_attends_nothing():
    """Scores all -inf (not by the mask: by the data) are a row that sees no key, O = 0 and L = -inf,
    as PyTorch's SDPA math path gives since 2.5 (_safe_softmax)."""
    q, k, v = _qkv(2, 1, 1, 3, 5, 16)
    q[0, 1, 0] = 0.0
    q[0, 1, 0, 0] = 1.0
    k[0, :, 0, 0] = -np.inf  # q_1 . k_j = -inf for every key j
    with np.errstate(invalid="ignore"):
        out, lse = attention_naive(q, k, v)
    assert (out[0, 1, 0] == 0).all() and np.isneginf(lse[0, 0, 1])


def test_backward_propagates_nan():
    q, k, v = _qkv(3, 1, 1, 6, 6, 16)
    k[0, 4, 0, 1] = np.nan
    with np.errstate(invalid="ignore"):
        out, lse = attention_naive(q, k, v, causal=True)
        dq, dk, dv = attention_backward(out, q, k, v, out, lse, causal=True)
    seen = causal_mask(6, 6)[:, 4]  # rows 4 and 5 see key 4: their out and lse are NaN
    assert np.isnan(out[0, :, 0]).any(axis=-1).tolist() == seen.tolist()
    assert np.isnan(dq[0, seen]).all() and np.isnan(dk[0, 4]).all() and np.isnan(dv[0, 4]).any()


# --------------------------------------------------------------------------- GQA / MQA

GQA = [(4, 4), (4, 2), (4, 1), (6, 3), (8, 2)]  # (H, H_kv): MHA, GQA, MQA


def _gqa_inputs(seed, b, h, hkv, nq, nk, d):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, nq, h, d))
    k, v = rng.standard_normal((b, nk, hkv, d)), rng.standard_normal((b, nk, hkv, d))
    return q, k, v, rng.standard_normal((b, nq, h, d))


@pytest.mark.parametrize("h,hkv", GQA)
@pytest.mark.parametrize("nq,nk", [(7, 17), (17, 7), (33, 33)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_forward_is_mha_per_query_head(h, hkv, nq, nk, causal):
    """Query head i of a GQA call is MHA of q head i with k/v head i // (H / H_kv), for the naive
    oracle and both tiled algorithms (checked head by head, not through repeat_kv)."""
    q, k, v, _ = _gqa_inputs(3, 2, h, hkv, nq, nk, 16)
    group = h // hkv
    for fwd in (attention_naive, attention_v1_tiled, attention_v2_tiled):
        kw = {} if fwd is attention_naive else dict(block_q=8, block_k=5)
        out, lse = fwd(q, k, v, causal=causal, **kw)
        assert out.shape == q.shape and lse.shape == (2, h, nq)
        for i in range(h):
            sl = slice(i, i + 1)
            kv = slice(i // group, i // group + 1)
            o1, l1 = attention_naive(q[:, :, sl], k[:, :, kv], v[:, :, kv], causal=causal)
            np.testing.assert_allclose(out[:, :, sl], o1, **TOL)
            _assert_lse_equal(lse[:, sl], l1)


@pytest.mark.parametrize("h,hkv", GQA)
@pytest.mark.parametrize("nq,nk", [(7, 17), (17, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_backward_sums_over_the_group(h, hkv, nq, nk, causal):
    """dQ per query head as MHA; dK, dV of a k/v head = the sum of its group's MHA gradients
    (attention_backward and the tiled FA2 backward)."""
    q, k, v, do = _gqa_inputs(5, 2, h, hkv, nq, nk, 16)
    out, lse = attention_naive(q, k, v, causal=causal)
    group = h // hkv
    dq_ref, dk_ref, dv_ref = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for i in range(h):
        sl, j = slice(i, i + 1), i // group
        kv = slice(j, j + 1)
        g = attention_backward(do[:, :, sl], q[:, :, sl], k[:, :, kv], v[:, :, kv], out[:, :, sl], lse[:, sl],
                               causal=causal)
        dq_ref[:, :, sl] = g[0]
        dk_ref[:, :, kv] += g[1]
        dv_ref[:, :, kv] += g[2]
    for bwd in (attention_backward, attention_backward_tiled):
        kw = {} if bwd is attention_backward else dict(block_q=8, block_k=5)
        dq, dk, dv = bwd(do, q, k, v, out, lse, causal=causal, **kw)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        for got, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
            np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_gqa_backward_finite_differences():
    """The GQA gradients of k and v are those of the loss <dO, O(q, k, v)> (central differences)."""
    q, k, v, do = _gqa_inputs(7, 1, 4, 2, 5, 6, 8)
    _, dk, dv = attention_backward(do, q, k, v, *attention_naive(q, k, v, causal=True), causal=True)
    loss = lambda kk, vv: float((attention_naive(q, kk, vv, causal=True)[0] * do).sum())
    eps = 1e-6
    for idx in [(0, 0, 0, 0), (0, 3, 1, 5), (0, 5, 1, 7)]:
        for x, g, is_k in ((k, dk, True), (v, dv, False)):
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            num = (loss(xp, v) - loss(xm, v)) if is_k else (loss(k, xp) - loss(k, xm))
            assert math.isclose(num / (2 * eps), g[idx], rel_tol=1e-5, abs_tol=1e-7)


def test_gqa_repeat_and_sum_groups():
    x = np.arange(2 * 3 * 2 * 4, dtype=float).reshape(2, 3, 2, 4)
    r = repeat_kv(x, 6)
    assert r.shape == (2, 3, 6, 4) and all((r[:, :, i] == x[:, :, i // 3]).all() for i in range(6))
    np.testing.assert_array_equal(sum_groups(r, 2), 3 * x)
    assert repeat_kv(x, 2) is x and sum_groups(x, 2) is x


def test_gqa_heads_must_divide():
    q, k, v, _ = _gqa_inputs(1, 1, 4, 3, 5, 5, 8)
    with pytest.raises(ValueError, match="heads do not divide"):
        attention_naive(q, k, v)
