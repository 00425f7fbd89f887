"""The NumPy twin of the kernels' dropout mask (cuflash.philox), and the oracle with that mask. CPU only."""
from __future__ import annotations

import math
import time
import tracemalloc

import numpy as np
import pytest

from cuflash import philox
from cuflash.philox import (
    check_dropout,
    dropout_keep_mask,
    dropout_scale,
    dropout_threshold,
    dropout_uniforms,
    philox4x32_10,
    quantised_p,
    seed_key,
)
from cuflash.reference import (
    attention_backward,
    attention_naive,
    attention_v1_tiled,
    attention_v2_tiled,
    causal_mask,
)

U32 = 0xFFFFFFFF

# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key, expected output).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((U32,) * 4, (U32, U32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


# --------------------------------------------------------------------------- scalar reference


def philox_scalar(ctr, key):
    """Philox4x32-10 in plain Python ints, written from the paper's definition."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & U32, (k1 + 0xBB67AE85) & U32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & U32, (p0 >> 32) ^ c3 ^ k1, p0 & U32
    return c0, c1, c2, c3


def uniform_scalar(seed, heads, b, h, i, j):
    """The 16-bit uniform of element (b, h, i, j), straight from the mapping's definition."""
    r, gp, hh = i // 16, i % 8, (i % 16) // 8
    c, jj = j // 16, j % 16
    s, tp, e = jj // 8, (jj % 8) // 2, jj % 2
    out = philox_scalar((c * 4 + tp, r * 8 + gp, b * heads + h, 0), (seed & U32, seed >> 32))
    idx = hh * 4 + s * 2 + e
    return (out[idx // 2] >> (16 * (idx % 2))) & 0xFFFF


def _five_sigma(kept, n, keep_prob):
    sigma = math.sqrt(keep_prob * (1 - keep_prob) / n)
    return abs(kept / n - keep_prob) <= 5 * sigma


# --------------------------------------------------------------------------- Philox itself


@pytest.mark.parametrize("ctr, key, want", KNOWN_ANSWERS)
def test_known_answers(ctr, key, want):
    assert tuple(int(x) for x in philox4x32_10(np.array(ctr, np.uint32), np.array(key, np.uint32))) == want
    assert philox_scalar(ctr, key) == want
    got = philox4x32_10([ctr, ctr], key)  # lists of Python ints; a shared key
    assert got.dtype == np.uint32 and got.shape == (2, 4)
    assert [tuple(map(int, g)) for g in got] == [want, want]


def test_vectorised_matches_scalar():
    rng = np.random.default_rng(0)
    ctr = rng.integers(0, 2**32, (257, 4), dtype=np.uint64).astype(np.uint32)
    key = rng.integers(0, 2**32, (257, 2), dtype=np.uint64).astype(np.uint32)
    ctr[:8] = [[0, 0, 0, 0], [U32] * 4, [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [U32, 0, U32, 0],
               [0, U32, 0, U32]]
    got = philox4x32_10(ctr, key)
    for c, k, g in zip(ctr, key, got):
        assert tuple(map(int, g)) == philox_scalar(tuple(map(int, c)), tuple(map(int, k)))
    # broadcasting: counters (3, 5, 4) with keys (5, 2), and one key (2,) for all
    c3 = ctr[:15].reshape(3, 5, 4)
    got = philox4x32_10(c3, key[:5])
    assert got.shape == (3, 5, 4)
    for a in range(3):
        for b in range(5):
            assert tuple(map(int, got[a, b])) == philox_scalar(tuple(map(int, c3[a, b])), tuple(map(int, key[b])))
    got = philox4x32_10(c3, key[7])
    assert tuple(map(int, got[2, 4])) == philox_scalar(tuple(map(int, c3[2, 4])), tuple(map(int, key[7])))
    # other integer dtypes holding 32-bit values give the same
    np.testing.assert_array_equal(philox4x32_10(ctr.astype(np.int64), key.astype(np.uint64)), philox4x32_10(ctr, key))


def test_philox_argument_checks():
    with pytest.raises(TypeError, match="counter"):
        philox4x32_10(np.zeros(4, np.float32), [0, 0])
    with pytest.raises(ValueError, match="counter"):
        philox4x32_10(np.zeros(3, np.uint32), [0, 0])
    with pytest.raises(ValueError, match="key"):
        philox4x32_10(np.zeros(4, np.uint32), [0, 0, 0])
    with pytest.raises(ValueError, match="key"):
        philox4x32_10(np.zeros(4, np.uint32), [-1, 0])
    with pytest.raises(ValueError, match="counter"):
        philox4x32_10([2**32, 0, 0, 0], [0, 0])


# --------------------------------------------------------------------------- the mask's mapping

SEEDS = [0, 1, 0x0123456789ABCDEF, 2**64 - 1]


def test_seed_key():
    assert seed_key(0x0123456789ABCDEF) == (0x89ABCDEF, 0x01234567)
    assert seed_key(2**64 - 1) == (U32, U32)
    assert seed_key(np.uint64(5)) == (5, 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_uniforms_match_scalar_definition(seed):
    b, h, nq, nk = 2, 3, 77, 200
    u = dropout_uniforms(seed, b, h, nq, nk)
    assert u.dtype == np.uint16 and u.shape == (b, h, nq, nk)
    rng = np.random.default_rng(seed % 2**32)
    picks = [tuple(int(rng.integers(0, n)) for n in (b, h, nq, nk)) for _ in range(300)]
    picks += [(0, 0, 0, 0), (b - 1, h - 1, nq - 1, nk - 1), (1, 2, 64, 199), (0, 1, 76, 16)]
    for bi, hi, i, j in picks:
        assert int(u[bi, hi, i, j]) == uniform_scalar(seed, h, bi, hi, i, j), (bi, hi, i, j)


def test_one_call_fills_one_mma_fragment():
    """The 8 halves of one Philox call are rows {i, i+8} x keys {j, j+1, j+8, j+9} of a 16 x 16 block."""
    seed, b, h, nq, nk = 0xDEADBEEF12345678, 2, 3, 96, 160
    u = dropout_uniforms(seed, b, h, nq, nk)
    k0, k1 = seed & U32, seed >> 32
    rng = np.random.default_rng(1)
    for _ in range(40):
        bi, hi = int(rng.integers(b)), int(rng.integers(h))
        r, c = int(rng.integers(nq // 16)), int(rng.integers(nk // 16))
        gp, tp = int(rng.integers(8)), int(rng.integers(4))
        out = philox_scalar((c * 4 + tp, r * 8 + gp, bi * h + hi, 0), (k0, k1))
        halves = [(out[n] >> (16 * half)) & 0xFFFF for n in range(4) for half in range(2)]  # halves[idx]
        i, j = 16 * r + gp, 16 * c + 2 * tp
        for hh in range(2):
            for s in range(2):
                for e in range(2):
                    assert int(u[bi, hi, i + 8 * hh, j + 8 * s + e]) == halves[hh * 4 + s * 2 + e]


def test_mask_depends_only_on_position():
    """A crop of a bigger problem's mask, and (b, h) enters only through bh = b * heads + h."""
    seed = 77
    small = dropout_uniforms(seed, 2, 3, 77, 45)
    big = dropout_uniforms(seed, 2, 3, 160, 256)
    np.testing.assert_array_equal(small, big[:, :, :77, :45])
    flat = dropout_uniforms(seed, 1, 6, 77, 45)
    np.testing.assert_array_equal(flat[0], small.reshape(6, 77, 45))
    one = dropout_uniforms(seed, 1, 1, 1, 1)
    assert one[0, 0, 0, 0] == small[0, 0, 0, 0]


@pytest.mark.parametrize("chunk", [1, 32, 100, 1000, 1 << 22])
def test_chunking_does_not_change_the_mask(monkeypatch, chunk):
    want = np.stack([np.stack([np.array([[uniform_scalar(5, 3, b, h, i, j) for j in range(35)] for i in range(19)])
                               for h in range(3)]) for b in range(2)])
    monkeypatch.setattr(philox, "_CHUNK_CALLS", chunk)
    np.testing.assert_array_equal(dropout_uniforms(5, 2, 3, 19, 35), want)
    np.testing.assert_array_equal(dropout_keep_mask(5, 2, 3, 19, 35, 0.3), want >= dropout_threshold(0.3))


def test_degenerate_shapes():
    assert dropout_keep_mask(1, 0, 3, 5, 5, 0.5).shape == (0, 3, 5, 5)
    assert dropout_keep_mask(1, 2, 3, 0, 5, 0.5).shape == (2, 3, 0, 5)
    assert dropout_uniforms(1, 2, 3, 5, 0).shape == (2, 3, 5, 0)
    with pytest.raises(TypeError, match="seqlen_q"):
        dropout_keep_mask(1, 2, 3, 5.0, 5, 0.5)
    with pytest.raises(ValueError, match="heads"):
        dropout_uniforms(1, 2, -3, 5, 5)


def test_seeds_and_heads_give_different_masks():
    p, shape = 0.5, (2, 3, 64, 64)
    m = dropout_keep_mask(1234, *shape, p)
    np.testing.assert_array_equal(m, dropout_keep_mask(1234, *shape, p))  # same seed, same mask
    for other in (1235, 1234 + 2**32, 1234 + 2**63):  # low word, high word, top bit of the seed
        agree = (m == dropout_keep_mask(other, *shape, p)).mean()
        assert 0.45 < agree < 0.55, (other, agree)  # independent masks agree on about half
    heads = m.reshape(6, -1)
    for a in range(6):
        for b in range(a + 1, 6):
            assert 0.45 < (heads[a] == heads[b]).mean() < 0.55, (a, b)
    # rows and columns of one head are not copies of each other either (counter lanes all used)
    one = m[1, 2]
    assert not (one[:16] == one[16:32]).all() and not (one[:, :16] == one[:, 16:32]).all()
    assert not (one[:8] == one[8:16]).all() and not (one[:, :8] == one[:, 8:16]).all()


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("p", [0.01, 0.1, 0.17, 0.5, 0.9])
def test_kept_fraction(p):
    b, h, nq, nk = 2, 3, 300, 512
    mask = dropout_keep_mask(2024, b, h, nq, nk, p)
    assert mask.dtype == np.bool_ and mask.shape == (b, h, nq, nk)
    keep = 1 - dropout_threshold(p) / 65536
    assert _five_sigma(int(mask.sum()), mask.size, keep), (mask.mean(), keep)
    # each of the 256 positions in a 16 x 16 block (each lane of a Philox call) is fair too
    n_rows = nq // 16 * 16
    blocks = mask[:, :, :n_rows].reshape(b, h, n_rows // 16, 16, nk // 16, 16)
    per_pos = blocks.sum(axis=(0, 1, 2, 4))
    n = b * h * (n_rows // 16) * (nk // 16)
    for kept in per_pos.ravel():
        assert _five_sigma(int(kept), n, keep)


def test_uniforms_are_uniform():
    u = dropout_uniforms(99, 2, 4, 256, 256)
    counts = np.bincount((u >> 12).ravel(), minlength=16)  # 16 bins of the top 4 bits
    expected = u.size / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50, chi2  # 15 degrees of freedom: P(chi2 > 50) ~ 1e-5
    low = np.bincount((u & 15).ravel(), minlength=16)  # and the low bits
    assert float(((low - expected) ** 2 / expected).sum()) < 50


def test_big_mask_fast_and_small_temporaries():
    shape = (2, 3, 2048, 2048)
    t0 = time.perf_counter()
    mask = dropout_keep_mask(7, *shape, 0.1)
    took = time.perf_counter() - t0
    assert mask.shape == shape
    assert took < 5.0, f"{took:.2f} s for {shape}"  # ~0.15 s on one core of a laptop-class CPU
    del mask
    tracemalloc.start()
    try:
        mask = dropout_keep_mask(7, *shape, 0.1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - mask.nbytes < 32 * 2**20, f"temporaries peaked at {(peak - mask.nbytes) / 2**20:.0f} MiB"


# --------------------------------------------------------------------------- parameters and checks


def test_threshold_and_scale():
    assert dropout_threshold(0.0) == 0 and dropout_scale(0.0) == 1.0
    assert dropout_threshold(0) == 0
    assert dropout_threshold(0.5) == 32768 and dropout_scale(0.5) == 2.0
    assert dropout_threshold(0.25) == 16384 and dropout_scale(0.25) == 65536 / 49152
    assert dropout_threshold(0.1) == 6554  # round(6553.6)
    assert dropout_threshold(1e-6) == 0 and dropout_scale(1e-6) == 1.0  # below half a step: nothing dropped
    assert dropout_threshold(1 - 1e-9) == 65535 and dropout_scale(1 - 1e-9) == 65536.0
    assert dropout_threshold(np.float32(0.5)) == 32768
    for p in np.linspace(0, 0.999, 1001):
        t = dropout_threshold(float(p))
        assert 0 <= t <= 65535 and abs(t - p * 65536) <= 0.5
        # 1 / (1 - T/65536) is exactly 65536 / (65536 - T): the oracle given quantised_p scales the same
        assert 1.0 / (1.0 - quantised_p(float(p))) == dropout_scale(float(p))
        assert quantised_p(float(p)) == t / 65536


def test_check_dropout_accepts():
    assert check_dropout(0.0, None) == (0.0, None)
    assert check_dropout(0, None) == (0.0, None)
    assert check_dropout(0.0, 5) == (0.0, 5)
    assert check_dropout(0.1, 2**64 - 1) == (0.1, 2**64 - 1)
    assert check_dropout(np.float64(0.3), np.uint64(7)) == (0.3, 7)
    assert check_dropout(0.3, np.int64(7)) == (0.3, 7)
    assert check_dropout(0.3, None, require_seed=False) == (0.3, None)
    p, s = check_dropout(np.float32(0.25), 3)
    assert type(p) is float and type(s) is int


@pytest.mark.parametrize("p, seed, exc, match", [
    ("0.1", 1, TypeError, "dropout_p"),
    (None, 1, TypeError, "dropout_p"),
    (True, 1, TypeError, "dropout_p"),
    (1.0, 1, ValueError, "dropout_p"),
    (1, 1, ValueError, "dropout_p"),
    (-0.1, 1, ValueError, "dropout_p"),
    (float("nan"), 1, ValueError, "dropout_p"),
    (float("inf"), 1, ValueError, "dropout_p"),
    (0.1, None, ValueError, "seed is required when dropout_p > 0"),
    (0.1, -1, ValueError, "seed"),
    (0.1, 2**64, ValueError, "seed"),
    (0.1, 1.0, TypeError, "seed"),
    (0.1, "1", TypeError, "seed"),
    (0.1, True, TypeError, "seed"),
    (0.0, -1, ValueError, "seed"),  # a seed given with p = 0 is still checked
])
def test_check_dropout_errors(p, seed, exc, match):
    with pytest.raises(exc, match=match):
        check_dropout(p, seed)


def test_missing_seed_message_says_reuse_it_in_backward():
    with pytest.raises(ValueError) as e:
        check_dropout(0.2, None)
    msg = str(e.value)
    assert "same seed" in msg and "attention_backward" in msg and "2**64" in msg


def test_keep_mask_checks_its_arguments():
    with pytest.raises(ValueError, match="seed is required"):
        dropout_keep_mask(None, 1, 1, 4, 4, 0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_keep_mask(1, 1, 1, 4, 4, 1.0)
    assert dropout_keep_mask(None, 1, 2, 4, 5, 0.0).all()  # p = 0: everything kept, no seed needed
    assert dropout_keep_mask(3, 1, 2, 4, 5, 1e-6).all()  # T = 0


# --------------------------------------------------------------------------- the oracle with this mask


def _qkv(seed, b, h, nq, nk, d):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, n, h, d)) for n in (nq, nk, nk))


ORACLE_CASES = [  # (b, h, nq, nk, causal, p)
    (2, 3, 37, 53, False, 0.17),
    (2, 3, 37, 53, True, 0.5),
    (1, 2, 53, 21, True, 0.1),  # nq > nk: fully masked causal rows
    (2, 1, 40, 40, False, 0.9),
]


@pytest.mark.parametrize("b, h, nq, nk, causal, p", ORACLE_CASES)
def test_reference_forwards_agree_with_philox_mask(b, h, nq, nk, causal, p):
    q, k, v = _qkv(nq * nk, b, h, nq, nk, 16)
    mask = dropout_keep_mask(31337, b, h, nq, nk, p)
    kw = dict(causal=causal, dropout_mask=mask, dropout_p=quantised_p(p))
    out, lse = attention_naive(q, k, v, **kw)
    # the kernels' definition, written out: O = (P o mask) V * dropout_scale(p), L undropped
    s = np.einsum("bihd,bjhd->bhij", q, k) / 4.0
    if causal:
        s = np.where(causal_mask(nq, nk), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = e.sum(-1, keepdims=True)
    pm = np.where(l > 0, e / np.where(l > 0, l, 1), 0) * mask * dropout_scale(p)
    np.testing.assert_allclose(out, np.einsum("bhij,bjhd->bihd", pm, v), rtol=1e-12, atol=1e-12)
    out0, lse0 = attention_naive(q, k, v, causal=causal)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse0))
    np.testing.assert_allclose(lse[np.isfinite(lse0)], lse0[np.isfinite(lse0)], rtol=1e-12)
    assert not np.allclose(out, out0)
    for fwd in (attention_v1_tiled, attention_v2_tiled):
        for bq, bk in ((16, 16), (8, 5), (64, 128)):
            o, ls = fwd(q, k, v, block_q=bq, block_k=bk, **kw)
            np.testing.assert_allclose(o, out, rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(np.isneginf(ls), np.isneginf(lse))
            np.testing.assert_allclose(ls[np.isfinite(lse)], lse[np.isfinite(lse)], rtol=1e-12)


@pytest.mark.parametrize("b, h, nq, nk, causal, p", ORACLE_CASES[:3])
def test_reference_backward_with_philox_mask(b, h, nq, nk, causal, p):
    """attention_backward with the Philox mask: dV = (P o Z)^T dO and finite differences of the naive forward."""
    q, k, v = _qkv(nq + nk, b, h, nq, nk, 16)
    rng = np.random.default_rng(3)
    dout = rng.standard_normal(q.shape)
    mask = dropout_keep_mask(2**63 + 11, b, h, nq, nk, p)
    kw = dict(causal=causal, dropout_mask=mask, dropout_p=quantised_p(p))
    out, lse = attention_naive(q, k, v, **kw)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, **kw)
    # dV, written out with the kernels' scale
    s = np.einsum("bihd,bjhd->bhij", q, k) / 4.0
    if causal:
        s = np.where(causal_mask(nq, nk), s, -np.inf)
    lse_safe = np.where(np.isneginf(lse), np.inf, lse)
    pz = np.exp(s - lse_safe[..., None]) * mask * dropout_scale(p)
    np.testing.assert_allclose(dv, np.einsum("bhij,bihd->bjhd", pz, dout), rtol=1e-10, atol=1e-12)

    def loss(q, k, v):
        return float((attention_naive(q, k, v, **kw)[0] * dout).sum())

    eps = 1e-5
    for x, g in zip((q, k, v), (dq, dk, dv)):
        for _ in range(4):
            idx = tuple(int(rng.integers(0, n)) for n in x.shape)
            old = x[idx]
            x[idx] = old + eps
            up = loss(q, k, v)
            x[idx] = old - eps
            down = loss(q, k, v)
            x[idx] = old
            assert abs((up - down) / (2 * eps) - g[idx]) <= 1e-6 * max(1.0, abs(g[idx]))
    # dropping changes the gradients (the mask is really applied in the backward too)
    g0 = attention_backward(dout, q, k, v, *attention_naive(q, k, v, causal=causal), causal=causal)
    assert not np.allclose(dv, g0[2])
