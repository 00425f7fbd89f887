"""attn/score_mod.cuh: ScoreMod<V> on fragment tiles, against NumPy.

Softcap (V::kSoftcap): apply() turns each raw score s into t = tanh(s * softcap_scale) with the
special function unit's tanh.approx.f32, whose error the PTX ISA bounds at about 2^-11 relative;
checked here with rtol 2^-10 plus atol 2^-20 (near 0 the instruction's absolute error), on scores
that reach the tanh's saturated range. grad(t) = 1 - t^2, in [0, 1], computed by one fmaf from
the kernel's own t (checked to 2^-22 against float64 from that t), and 0 for t = -inf (a masked
score: dS must stay 0, not 0 * -inf) and for |t| > 1. Without softcap apply() leaves the tile
bit for bit and grad is 1. The fragment placement is the frag.cuh contract (each element returns
to its own (row, col)).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cu.harness import kernel

ROWS = COLS = 32
pytestmark = pytest.mark.gpu


def _run(fn, s, softcap_scale):
    import cupy

    n = s.shape[0]
    s_d = cupy.asarray(s, dtype=cupy.float32)
    out = cupy.full(s.shape, cupy.nan, dtype=cupy.float32)
    grad = cupy.full(s.shape, cupy.nan, dtype=cupy.float32)
    kernel("score_mod", fn)((n,), (32,), (s_d, out, grad, np.float32(softcap_scale)))
    return cupy.asnumpy(out), cupy.asnumpy(grad)


def _scores(n=3, seed=0):
    rng = np.random.default_rng(seed)
    s = (rng.standard_normal((n, ROWS, COLS)) * 40).astype(np.float32)  # |s| up to ~150: saturated tanh too
    s[0, 0, :4] = [0.0, -0.0, 1e-30, -1e-30]
    return s


@pytest.mark.parametrize("softcap_scale", [0.125 / 30.0, 0.125 / 5.0, 1.0])
def test_softcap_value_and_derivative(softcap_scale):
    s = _scores()
    t, g = _run("score_mod_softcap", s, softcap_scale)
    want = np.tanh(s.astype(np.float64) * np.float32(softcap_scale))
    np.testing.assert_allclose(t, want, rtol=2.0**-10, atol=2.0**-20)
    assert np.all(np.abs(t) <= 1.0)
    tt = t.astype(np.float64)
    np.testing.assert_allclose(g, np.maximum(1.0 - tt * tt, 0.0), rtol=0, atol=2.0**-22)
    assert np.all((g >= 0) & (g <= 1))


def test_plain_leaves_the_tile_and_its_grad_is_one():
    s = _scores(seed=1)
    t, g = _run("score_mod_plain", s, 0.0)
    assert np.array_equal(t.view(np.uint32), s.view(np.uint32))
    assert np.all(g == 1.0)


def test_grad_of_masked_and_out_of_range_values_is_zero():
    import cupy

    x = np.array([-np.inf, np.inf, 1.0, -1.0, 1.5, 0.0, 0.5], dtype=np.float32)
    out = cupy.full(x.shape, cupy.nan, dtype=cupy.float32)
    kernel("score_mod", "grad_softcap")((1,), (32,), (cupy.asarray(x), out, np.int32(x.size)))
    np.testing.assert_array_equal(cupy.asnumpy(out), np.array([0, 0, 0, 0, 0, 1, 0.75], dtype=np.float32))
