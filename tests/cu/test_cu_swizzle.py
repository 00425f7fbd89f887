"""core/swizzle.cuh: swz<ROW_CHUNKS>(row, chunk), the XOR-swizzled shared-memory tile layout.

GPU: the header's addresses for every (row, chunk) of 256-row tiles equal the NumPy formula
    swz(row, chunk) = (row * CH + (chunk ^ (row % 8))) * 16.
CPU (on that formula): the layout is a bijection onto the tile's 16-byte chunks, the 8 rows an
ldmatrix 8x8 matrix reads (and the 8 chunks a quarter-warp of cp.async writes) fall in 8 distinct
16-byte bank groups, and the "step along the head dim is one XOR" consequence the mainloops use.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cu.harness import kernel

ROW_CHUNKS = (8, 16, 32)  # the harness instantiates these (head dims 64, 128, 256 in 16-bit elements)
ROWS = 256


def swz(row, chunk, ch):
    row, chunk = np.asarray(row), np.asarray(chunk)
    return (row * ch + (chunk ^ (row & 7))) * 16


def bank_group(addr):
    """The 16-byte group of the 32 x 4-byte banks a byte address falls in (0..7)."""
    return (np.asarray(addr) // 16) % 8


# --------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("ch", ROW_CHUNKS + (4, 12))
def test_swz_matches_formula(ch):
    """The swizzled form (CH a multiple of 8) and the padded one (head dims 32, 96: rows of CH + 1
    chunks, tests/test_smem_layout_twin.py checks its properties on the CPU)."""
    import cupy

    from tests.test_smem_layout_twin import swz as swz_any

    out = cupy.full(ROWS * ch, -1, dtype=cupy.int32)
    kernel("swizzle", f"swz_table_{ch}")(((ROWS * ch + 127) // 128,), (128,), (out, np.int32(ROWS)))
    got = cupy.asnumpy(out).reshape(ROWS, ch)
    rows, chunks = np.meshgrid(np.arange(ROWS), np.arange(ch), indexing="ij")
    np.testing.assert_array_equal(got, swz_any(rows, chunks, ch))


# --------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("ch", ROW_CHUNKS)
def test_layout_is_a_permutation_of_chunks_within_each_row(ch):
    rows, chunks = np.meshgrid(np.arange(ROWS), np.arange(ch), indexing="ij")
    a = swz(rows, chunks, ch)
    assert (a % 16 == 0).all()
    # each row stays in its own 16 * CH bytes, and covers them exactly once
    np.testing.assert_array_equal(a // (16 * ch), rows)
    np.testing.assert_array_equal(np.sort(a, axis=1), rows * 16 * ch + 16 * np.arange(ch))


@pytest.mark.parametrize("ch", ROW_CHUNKS)
def test_ldmatrix_rows_fall_in_distinct_bank_groups(ch):
    # Any 8 consecutive rows at one chunk (what one 8x8 matrix of ldmatrix reads, 16 bytes a row).
    for r0 in range(0, ROWS - 7):
        for c in range(ch):
            groups = bank_group(swz(np.arange(r0, r0 + 8), c, ch))
            assert len(set(groups.tolist())) == 8, (r0, c, groups)


@pytest.mark.parametrize("ch", ROW_CHUNKS)
def test_ldmatrix_x4_lane_addresses_of_the_mainloops(ch):
    # sm80/tile_copy.cuh LdmatrixOffsets: lanes 8 j .. 8 j + 7 give the 8 row addresses of matrix j.
    lane = np.arange(32)
    layouts = {
        "a_operand": (lane % 8 + ((lane // 8) % 2) * 8, lane // 16),
        "b_operand": (lane % 8 + (lane // 16) * 8, (lane // 8) % 2),
        "b_trans": (lane % 8 + ((lane // 8) % 2) * 8, lane // 16),
    }
    for name, (row, chunk) in layouts.items():
        for row0 in range(0, 64, 16):
            for kc in range(0, ch, 2):  # each k16 step moves two chunks: offset ^ (16 kc)
                addr = swz(row0 + row, chunk + kc, ch)
                for j in range(4):
                    assert len(set(bank_group(addr[8 * j: 8 * j + 8]).tolist())) == 8, (name, row0, kc, j)


@pytest.mark.parametrize("ch", ROW_CHUNKS)
def test_cp_async_quarter_warps_fall_in_distinct_bank_groups(ch):
    # sm80/tile_copy.cuh load_tile: thread i copies chunk i % CH of row i / CH (+ multiples of 8 rows).
    tid = np.arange(256)
    addr = swz(tid // ch, tid % ch, ch)
    for q in range(0, 256, 8):
        assert len(set(bank_group(addr[q: q + 8]).tolist())) == 8, q


@pytest.mark.parametrize("ch", ROW_CHUNKS)
def test_stepping_along_the_head_dim_is_one_xor(ch):
    # The mainloops keep swz(r, 0) per lane and reach chunk c as swz(r, 0) ^ (16 c).
    rows, chunks = np.meshgrid(np.arange(ROWS), np.arange(ch), indexing="ij")
    np.testing.assert_array_equal(swz(rows, chunks, ch), swz(rows, 0, ch) ^ (16 * chunks))


def test_xor_step_needs_a_power_of_two_row_chunks():
    # swz admits any multiple of 8 (e.g. CH = 24, head dim 192), but the plain XOR step above then
    # breaks: row r's base r * CH * 16 is not aligned to the XOR's reach. chunk_step therefore XORs
    # within the 8-chunk group and adds across groups for such CH (tests/test_smem_layout_twin.py).
    ch = 24
    rows, chunks = np.meshgrid(np.arange(16), np.arange(ch), indexing="ij")
    assert (swz(rows, chunks, ch) != (swz(rows, 0, ch) ^ (16 * chunks))).any()
    test_layout_is_a_permutation_of_chunks_within_each_row(ch)
    test_ldmatrix_rows_fall_in_distinct_bank_groups(ch)
