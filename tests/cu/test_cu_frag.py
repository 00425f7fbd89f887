"""core/frag.cuh: the fragment contract every attn/ policy is written against.

GPU: for warp tiles acc[MT][NT][4] each lane reports what FragSm80 / Direct / Transposed say
register [mt][nt][e] holds; it must be the documented m16n8 C layout (lane = 4 g + t):
    row 16 mt + g + 8 (e / 2), col 8 nt + 2 t + e % 2; row_of_half = 16 mt + g + 8 half;
    Direct (query, key) = (row, col); Transposed (query, key) = (col, row).
GPU: the same layout is what mma.sync m16n8k16 really produces (frag_mma.cu: A = I, B[k][n] =
16 k + n, so C's value names its own (row, col)), for bf16 and fp16 inputs.
CPU: the NumPy statement of the layout covers each element of the warp tile exactly once, and
the 4 lanes of a quad hold complete rows (what warp_max4 / warp_sum4 rely on).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cu.harness import frag_index, kernel

SHAPES = [(1, 1), (1, 8), (2, 4), (4, 2)]  # (MT, NT) instantiated in frag.cu


def _run_frag_map(mt_count, nt_count):
    import cupy

    n = 32 * mt_count * nt_count * 4
    out = cupy.full(6 * n, -1, dtype=cupy.int32)
    halves = cupy.full(32 * mt_count * 2, -1, dtype=cupy.int32)
    shape = cupy.full(4, -1, dtype=cupy.int32)
    kernel("frag", f"frag_map_{mt_count}x{nt_count}")((1,), (32,), (out, halves, shape))
    return (cupy.asnumpy(out).reshape(6, 32, mt_count, nt_count, 4), cupy.asnumpy(halves).reshape(32, mt_count, 2),
            cupy.asnumpy(shape))


@pytest.mark.gpu
@pytest.mark.parametrize("mt_count, nt_count", SHAPES)
def test_frag_map_is_the_documented_c_layout(mt_count, nt_count):
    out, halves, shape = _run_frag_map(mt_count, nt_count)
    row, col = frag_index(mt_count, nt_count)
    np.testing.assert_array_equal(shape, [16 * mt_count, 8 * nt_count, mt_count, nt_count])
    np.testing.assert_array_equal(out[0], row, err_msg="FragSm80::row")
    np.testing.assert_array_equal(out[1], col, err_msg="FragSm80::col")
    np.testing.assert_array_equal(out[2], row, err_msg="Direct::query")
    np.testing.assert_array_equal(out[3], col, err_msg="Direct::key")
    np.testing.assert_array_equal(out[4], col, err_msg="Transposed::query")
    np.testing.assert_array_equal(out[5], row, err_msg="Transposed::key")
    lane, mt, half = np.meshgrid(np.arange(32), np.arange(mt_count), np.arange(2), indexing="ij")
    np.testing.assert_array_equal(halves, 16 * mt + lane // 4 + 8 * half, err_msg="FragSm80::row_of_half")
    # row_of_half(mt, e / 2) is row(mt, e)
    np.testing.assert_array_equal(halves[:, :, None, [0, 0, 1, 1]].repeat(nt_count, axis=2), out[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_mma_sync_produces_the_documented_c_layout(dtype):
    import cupy

    out = cupy.full(32 * 4, np.nan, dtype=cupy.float32)
    kernel("frag_mma", f"mma_contract_{dtype}")((1,), (32,), (out,))
    got = cupy.asnumpy(out).reshape(32, 4)
    row, col = frag_index(1, 1)
    np.testing.assert_array_equal(got, (16 * row + col)[:, 0, 0, :].astype(np.float32))


# --------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("mt_count, nt_count", SHAPES)
def test_layout_covers_the_warp_tile_once(mt_count, nt_count):
    row, col = frag_index(mt_count, nt_count)
    flat = (row * 8 * nt_count + col).ravel()
    np.testing.assert_array_equal(np.sort(flat), np.arange(16 * mt_count * 8 * nt_count))


@pytest.mark.parametrize("mt_count, nt_count", SHAPES)
def test_a_quad_holds_complete_rows(mt_count, nt_count):
    row, col = frag_index(mt_count, nt_count)
    for r in range(16 * mt_count):
        lanes = np.unique(np.nonzero(row == r)[0])
        assert len(lanes) == 4 and lanes[0] % 4 == 0 and (np.diff(lanes) == 1).all(), (r, lanes)
        np.testing.assert_array_equal(np.sort(col[row == r]), np.arange(8 * nt_count))
