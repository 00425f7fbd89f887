"""Attention sinks without a GPU (issue 13): the exact rescale of (out, lse) and the backward
through (out', lse') against the definition (a sink column in every row's softmax), its gradient
by finite differences, and the argument checks. GPU tests: tests/gpu/test_sinks_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import reference, sinks

MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (3, -1)), (False, (2, 1))]


def _case(seed, b=2, nq=5, nk=7, h=4, hk=2, d=8):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((b, nq, h, d)), rng.standard_normal((b, nk, hk, d)), rng.standard_normal((b, nk, hk, d))
    return q, k, v, rng.standard_normal(h) * 2


@pytest.mark.parametrize("causal,window", MASKS)
def test_rescale_equals_the_definition(causal, window):
    q, k, v, s = _case(1)
    out, lse = reference.attention_naive(q, k, v, causal=causal, window_size=window)
    got_out, got_lse = sinks.apply(out, lse, s)
    want_out, want_lse = reference.attention_sinks(q, k, v, s, causal=causal, window_size=window)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12, atol=1e-12)


def test_rows_without_keys_give_zero_and_the_sink():
    q, k, v, s = _case(2, nq=4, nk=2)
    # causal with more queries than keys, top-left: the first rows see keys; bottom-right: the
    # first nq - nk rows see none
    out, lse = reference.attention_naive(q, k, v, causal=True)
    assert np.isneginf(lse[:, :, 0]).all()
    o2, l2 = sinks.apply(out, lse, s)
    assert (o2[:, 0] == 0).all() and np.allclose(l2[:, :, 0], s[None, :])


@pytest.mark.parametrize("causal,window", MASKS)
def test_backward_through_the_rescaled_outputs_is_the_gradient(causal, window):
    """dq, dk, dv from the ordinary backward fed (out', lse') equal finite differences of
    L = sum(dout o out_sinks(q, k, v)); d sinks from sinks.grad equals its finite difference."""
    q, k, v, s = _case(3, b=1, nq=3, nk=4, h=2, hk=1, d=4)
    dout = np.random.default_rng(4).standard_normal(q.shape)
    out, lse = reference.attention_sinks(q, k, v, s, causal=causal, window_size=window)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, window_size=window)
    ds = sinks.grad(dout, out, lse, s)

    def loss(q_=q, k_=k, v_=v, s_=s):
        o, _ = reference.attention_sinks(q_, k_, v_, s_, causal=causal, window_size=window)
        return float((dout * o).sum())

    eps = 1e-6
    for x, g, name in ((q, dq, "q"), (k, dk, "k"), (v, dv, "v"), (s, ds, "sinks")):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            kw = {"q": dict(q_=xp), "k": dict(k_=xp), "v": dict(v_=xp), "sinks": dict(s_=xp)}[name]
            kwm = {"q": dict(q_=xm), "k": dict(k_=xm), "v": dict(v_=xm), "sinks": dict(s_=xm)}[name]
            num[idx] = (loss(**kw) - loss(**kwm)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-7, err_msg=name)


def test_checks_name_the_argument():
    q = np.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"shape \(heads=4,\)"):
        sinks.check(np.zeros(3), 4, q)
    with pytest.raises(TypeError, match="floating"):
        sinks.check(np.zeros(4, dtype=np.int32), 4, q)
    with pytest.raises(TypeError, match="numpy array like q"):
        sinks.check([0.0] * 4, 4, q)
