"""attn/dropout.cuh: keep bits per (query block R, key block C, lane) vs cuflash/philox.py, bit for bit.

The twin's map (cuflash/philox.py docstring, attn/dropout.cuh header): thread (g, t) of block
(R, C) of head bh gets Philox4x32-10 of counter (4 C + t, 8 R + g, bh, 0), key (seed lo, seed hi);
bit idx = 4 hh + 2 s + e (16-bit half idx % 2 of word idx / 2, kept iff >= threshold) belongs to
query 16 R + g + 8 hh, key 16 C + 8 s + 2 t + e.

GPU, for a grid of blocks of one head (bh = 4 of batch 2 x heads 3), two seeds (one with both key
words nonzero and the top bit set) and two dropout rates:
  * Dropout::bits8 and dropout_bits8 equal the bits read off dropout_keep_mask;
  * Dropout::kept(bits, nt, e) at the C-fragment position of (nt, e) is dropout_keep_mask;
  * zero_dropped(acc, kb = 1, bits) zeroes exactly the dropped elements of n8 tiles 2, 3 and
    leaves tiles 0, 1 alone;
  * bits8_transposed (the dK/dV kernel's S^T order) read back at its documented positions
    (key 16 C + g + 8 h, query 16 R + 8 s + 2 t + e, bit 4 s + 2 h + e) is dropout_keep_mask;
  * far blocks (R ~ 4000, C ~ 70000) equal the twin's philox4x32_10 on the documented counter.
CPU: the bit helper used for the far blocks agrees with dropout_keep_mask.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuflash.philox import dropout_keep_mask, dropout_threshold, philox4x32_10, seed_key
from tests.cu.harness import kernel

SEEDS = [12345, 2**64 - 2**31 + 7]
PS = [0.1, 0.5]
BATCH, HEADS, B, H = 2, 3, 1, 1
BH = B * HEADS + H
N_R, N_C = 5, 7  # blocks of the near grid: 80 queries x 112 keys


def bits8_twin(seed, bh, R, C, threshold):
    """Expected bits8 of every lane of block (R, C): uint32 (32,), from philox4x32_10 directly."""
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    counter = np.stack([4 * C + t, 8 * R + g, np.full(32, bh), np.zeros(32, np.int64)], axis=-1)
    words = philox4x32_10(counter.astype(np.uint64), np.array(seed_key(seed), np.uint64))
    halves = words.astype("<u4").view("<u2").reshape(32, 8)  # idx = 2 word + half
    return ((halves >= threshold).astype(np.uint32) << np.arange(8, dtype=np.uint32)).sum(axis=1).astype(np.uint32)


def bits_from_mask(keep):
    """bits[R, C, lane] read off a (16 N_R, 16 N_C) keep mask with the documented map."""
    n_r, n_c = keep.shape[0] // 16, keep.shape[1] // 16
    out = np.zeros((n_r, n_c, 32), np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for hh in range(2):
            for s in range(2):
                for e in range(2):
                    bit = keep[g + 8 * hh::16, 8 * s + 2 * t + e::16].astype(np.uint32)
                    out[:, :, lane] |= bit << (4 * hh + 2 * s + e)
    return out


def _run(seed, threshold, r0, c0, n_r, n_c):
    import cupy

    nb = n_r * n_c
    u32 = cupy.uint32
    bits, free, bits_t = (cupy.zeros((nb, 32), u32) for _ in range(3))
    keep = cupy.full((16 * n_r, 16 * n_c), 7, cupy.uint8)
    keep_t = cupy.full((16 * n_r, 16 * n_c), 7, cupy.uint8)
    zeroed = cupy.full((16 * n_r, 16 * n_c), np.nan, cupy.float32)
    others = cupy.zeros((nb, 32), cupy.int32)
    kernel("dropout", "dropout_blocks")((n_c, n_r), (32,), (
        np.uint64(seed), np.uint32(threshold), np.int32(BH), np.int32(r0), np.int32(c0),
        bits, free, bits_t, keep, keep_t, zeroed, others))
    get = cupy.asnumpy
    return dict(bits=get(bits).reshape(n_r, n_c, 32), free=get(free).reshape(n_r, n_c, 32),
                bits_t=get(bits_t).reshape(n_r, n_c, 32), keep=get(keep), keep_t=get(keep_t), zeroed=get(zeroed),
                others=get(others))


@pytest.mark.gpu
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("seed", SEEDS, ids=["small", "big"])
def test_keep_bits_match_philox_twin(seed, p):
    threshold = dropout_threshold(p)
    keep = dropout_keep_mask(seed, BATCH, HEADS, 16 * N_R, 16 * N_C, p)[B, H]
    got = _run(seed, threshold, 0, 0, N_R, N_C)
    np.testing.assert_array_equal(got["bits"], bits_from_mask(keep), err_msg="Dropout::bits8")
    np.testing.assert_array_equal(got["free"], got["bits"], err_msg="dropout_bits8")
    np.testing.assert_array_equal(got["keep"], keep.astype(np.uint8), err_msg="Dropout::kept")
    np.testing.assert_array_equal(got["zeroed"], keep.astype(np.float32), err_msg="zero_dropped")
    assert got["others"].all(), "zero_dropped(kb = 1) touched n8 tiles 0, 1"
    np.testing.assert_array_equal(got["keep_t"], keep.astype(np.uint8), err_msg="bits8_transposed")
    assert 0 < keep.mean() < 1


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS, ids=["small", "big"])
def test_far_blocks_match_philox_twin(seed):
    threshold = dropout_threshold(0.3)
    r0, c0 = 4000, 70000
    got = _run(seed, threshold, r0, c0, 2, 3)
    for i in range(2):
        for j in range(3):
            np.testing.assert_array_equal(got["bits"][i, j], bits8_twin(seed, BH, r0 + i, c0 + j, threshold))
    np.testing.assert_array_equal(got["keep_t"], got["keep"])


# --------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("seed", SEEDS, ids=["small", "big"])
def test_bits_twin_agrees_with_keep_mask(seed):
    p = 0.3
    keep = dropout_keep_mask(seed, BATCH, HEADS, 16 * N_R, 16 * N_C, p)[B, H]
    want = bits_from_mask(keep)
    for R in range(N_R):
        for C in range(N_C):
            np.testing.assert_array_equal(bits8_twin(seed, BH, R, C, dropout_threshold(p)), want[R, C])
