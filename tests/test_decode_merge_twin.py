"""NumPy twin of kernels_cu/sm80/decode.cuh's merge_splits (the last split block's merge of every
split's lse and O, one item: a row's two columns), in float32 as on the device, against the
combine's definition (cuflash.merge_attention's arithmetic): out = sum_s exp(lse_s - m) O_s /
sum_s exp(lse_s - m), lse = m + log(sum), m the largest lse; a row no split saw gives 0 and -inf,
a NaN lse a NaN row. CPU only. If the loop changes in the header, change it here.

The merge is one pass: batches of U splits, lse and O loaded together, a running max rescaling the
sum and the accumulator (a batch past n_splits reads split 0 again and skips it)."""
import numpy as np
import pytest

U = 4  # kMergeBatch


def merge_twin(lse, o):
    """lse (n_splits,) float32, o (n_splits, 2) float32 -> (out (2,), lse) as merge_splits computes them."""
    f32 = np.float32
    n = len(lse)
    m, total, acc, nan = f32(-np.inf), f32(0), np.zeros(2, f32), False
    with np.errstate(invalid="ignore", over="ignore"):
        for s in range(0, n, U):
            idx = [s + u if s + u < n else 0 for u in range(U)]
            l, x = lse[idx], o[idx]
            m_new = m
            for u in range(U):
                nan |= bool(np.isnan(l[u]))
                m_new = m_new if np.isnan(l[u]) else max(m_new, l[u])  # fmaxf ignores a NaN operand
            if m_new != -np.inf:
                c = np.exp(f32(m - m_new), dtype=f32)
                total, acc = f32(total * c), (acc * c).astype(f32)
                for u in range(U):
                    if s + u < n:
                        w = np.exp(f32(l[u] - m_new), dtype=f32)
                        total = f32(total + w)
                        acc = (acc + w * x[u]).astype(f32)
                m = m_new
        inv = f32(np.nan) if nan else (f32(1) / total if total > 0 else f32(0))
        out_lse = f32(np.nan) if nan else (m if m == -np.inf else f32(m + np.log(total, dtype=f32)))
    return acc * inv, out_lse


def merge_reference(lse, o):
    """The combine's definition in float64."""
    lse, o = lse.astype(np.float64), o.astype(np.float64)
    if np.isnan(lse).any():
        return np.full(2, np.nan), np.nan
    m = lse.max()
    if m == -np.inf:
        return np.zeros(2), -np.inf
    w = np.exp(lse - m)
    return (w[:, None] * o).sum(0) / w.sum(), m + np.log(w.sum())


@pytest.mark.parametrize("n_splits", [1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("empty", [0.0, 0.3, 1.0], ids=["all-saw", "some-empty", "none-saw"])
def test_one_pass_merge_matches_the_combine(n_splits, empty):
    rng = np.random.default_rng(n_splits * 10 + int(empty * 10))
    for _ in range(20):
        lse = (rng.standard_normal(n_splits) * rng.choice([0.5, 5.0, 40.0])).astype(np.float32)
        lse[rng.random(n_splits) < empty] = -np.inf
        o = rng.standard_normal((n_splits, 2)).astype(np.float32)
        o[lse == -np.inf] = 0.0  # a split that saw no key writes O = 0
        out, out_lse = merge_twin(lse, o)
        ref, ref_lse = merge_reference(lse, o)
        if ref_lse == -np.inf:
            assert out_lse == -np.inf and (out == 0).all()
        else:
            np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)
            np.testing.assert_allclose(out_lse, ref_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("n_splits,bad", [(1, 0), (5, 4), (16, 7), (16, 0)])
def test_a_nan_lse_makes_the_row_nan(n_splits, bad):
    lse = np.linspace(-3, 3, n_splits).astype(np.float32)
    lse[bad] = np.nan
    out, out_lse = merge_twin(lse, np.ones((n_splits, 2), np.float32))
    assert np.isnan(out).all() and np.isnan(out_lse)


def test_a_rising_max_rescales_what_came_before():
    """The max grows batch by batch (every later split far larger): the early terms vanish, as in
    the two-pass form, and nothing overflows."""
    lse = np.arange(16, dtype=np.float32) * 30.0
    o = np.arange(32, dtype=np.float32).reshape(16, 2)
    out, out_lse = merge_twin(lse, o)
    ref, ref_lse = merge_reference(lse, o)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    np.testing.assert_allclose(out_lse, ref_lse, rtol=1e-6)
