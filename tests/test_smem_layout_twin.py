"""NumPy twin of the generalised sm80 shared-memory layout (kernels_cu/core/swizzle.cuh) and of the
tile copy's address stepping (kernels_cu/sm80/tile_copy.cuh), for every head dim a kernel may be
instantiated with (multiples of 16 up to 256; 32, 64, 96, 128, 256 are).

    ROW_CHUNKS % 8 == 0: swizzled, swz(r, c) = (r * CH + (c ^ (r % 8))) * 16
    otherwise:           padded,   swz(r, c) = r * (CH + 1) * 16 + c * 16
    chunk_step(swz(r, c0), k) = swz(r, c0 + k) for c0 in {0, 1}, k even
"""
from __future__ import annotations

import numpy as np
import pytest

from cuflash.tiles import smem_row_bytes

ROWS = 128
HEAD_DIMS = tuple(range(16, 257, 16))


def row_bytes(ch):
    return ch * 16 if ch % 8 == 0 else (ch + 1) * 16


def swz(row, chunk, ch):
    row, chunk = np.asarray(row), np.asarray(chunk)
    if ch % 8 == 0:
        return (row * ch + (chunk ^ (row & 7))) * 16
    return row * row_bytes(ch) + chunk * 16


def chunk_step(off, k, ch):
    off = np.asarray(off)
    if ch % 8 == 0 and ch & (ch - 1) == 0:
        return off ^ (16 * k)
    if ch % 8 == 0:
        return (off ^ (16 * (k % 8))) + 16 * (k - k % 8)
    return off + 16 * k


def bank_group(addr):
    return (np.asarray(addr) // 16) % 8


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_row_bytes_mirror(d):
    assert smem_row_bytes(d) == row_bytes(d // 8)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_layout_is_injective_and_rows_stay_in_their_stride(d):
    ch = d // 8
    rows, chunks = np.meshgrid(np.arange(ROWS), np.arange(ch), indexing="ij")
    a = swz(rows, chunks, ch)
    assert len(np.unique(a)) == a.size and (a % 16 == 0).all()
    np.testing.assert_array_equal(a // row_bytes(ch), rows)
    assert a.max() + 16 <= ROWS * row_bytes(ch)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_ldmatrix_phases_are_conflict_free(d):
    # 8 consecutive rows at one chunk (one 8x8 matrix of ldmatrix) land in 8 distinct 16-byte bank groups
    ch = d // 8
    for r0 in range(0, ROWS - 7):
        for c in range(ch):
            assert len(set(bank_group(swz(np.arange(r0, r0 + 8), c, ch)).tolist())) == 8, (d, r0, c)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_stepping_along_the_head_dim(d):
    ch = d // 8
    rows = np.arange(ROWS)
    for c0 in (0, 1):
        for k in range(0, ch - c0, 2):
            np.testing.assert_array_equal(chunk_step(swz(rows, c0, ch), k, ch), swz(rows, c0 + k, ch))


def test_steps_do_not_compose_past_one_group_at_d192():
    """Why tile_mma_ab steps once from the lane's offset for the second column split (d=192: its
    dK/dV columns start at chunk 12): a step of 12 then 2dp lands elsewhere (the d=192 backward
    bug: dK, dV wrong, dQ right, found on the H200), a single step of 12 + 2dp does not."""
    ch, rows = 24, np.arange(ROWS)
    for c0 in (0, 1):
        base = swz(rows, c0, ch)
        for dp in range(6):
            np.testing.assert_array_equal(chunk_step(base, 12 + 2 * dp, ch), swz(rows, c0 + 12 + 2 * dp, ch))
        assert any((chunk_step(chunk_step(base, 12, ch), 2 * dp, ch) != swz(rows, c0 + 12 + 2 * dp, ch)).any()
                   for dp in range(6))


@pytest.mark.parametrize("d", (32, 64, 96, 128, 256))
@pytest.mark.parametrize("threads", (32, 64, 128, 256))
def test_tile_copy_covers_every_chunk_once(d, threads):
    """load_tile's two forms write each (row, chunk) of a tile exactly once; the fast form's
    per-iteration address is the XOR-and-offset step of row r's (swizzled, STEP a power of two)."""
    ch, rows = d // 8, 64
    step = threads // ch if threads % ch == 0 else 0
    fast = step > 0 and rows % step == 0 and (ch % 8 or step & (step - 1) == 0)
    written = []
    for tid in range(threads):
        if fast:
            r, c = tid // ch, tid % ch
            dst = swz(r, c, ch)
            for i in range(rows // step):
                a = dst ^ (16 * ((i * step) & 7)) if ch % 8 == 0 else dst
                a = a + i * step * row_bytes(ch)
                assert a == swz(r + i * step, c, ch), (d, threads, tid, i)
                written.append(a)
        else:
            for i in range(-(-rows * ch // threads)):
                idx = tid + i * threads
                if idx < rows * ch:
                    written.append(int(swz(idx // ch, idx % ch, ch)))
    rr, cc = np.meshgrid(np.arange(rows), np.arange(ch), indexing="ij")
    assert sorted(int(x) for x in written) == sorted(swz(rr, cc, ch).ravel().tolist())


def _rows_below(dst, rows, ch):
    """tile_copy.cuh rows_below: the same chunk `rows` rows further down."""
    return (dst ^ (16 * (rows & 7))) + rows * row_bytes(ch) if ch % 8 == 0 else dst + rows * row_bytes(ch)


def _row_group_shape(d, threads, rows):
    """RowGroupTileCopy's (CH, kRowsPer) where kApplies holds, else None (the walk copies)."""
    ch = d // 8
    groups = threads // ch if threads % ch == 0 else 0
    per = rows // groups if groups and rows % groups == 0 else 0
    return (ch, per) if per > 0 and (ch % 8 or per & (per - 1) == 0 or per % 8 == 0) else None


ROW_GROUP_CASES = [(d, t, r) for d in (32, 64, 96, 128, 192, 256) for t in (64, 128, 256) for r in (32, 64, 128)
                   if _row_group_shape(d, t, r)]


@pytest.mark.parametrize("d,threads,rows", ROW_GROUP_CASES)
def test_row_group_copy_covers_every_chunk_once(d, threads, rows):
    """RowGroupTileCopy (thread t: chunk t % CH of kRowsPer consecutive rows from (t / CH) kRowsPer,
    the paged decode's GROUPED_PAGES copy) writes each (row, chunk) of the tile exactly once, each
    row's address one rows_below step from the thread's first row's, for every shape where kApplies
    holds; and a quarter-warp's 8 writes fall in 8 distinct bank groups where a row holds 8 chunks
    or more."""
    ch, per = _row_group_shape(d, threads, rows)
    written = {}
    for tid in range(threads):
        first, c = tid // ch * per, tid % ch
        dst = int(swz(first, c, ch))
        for j in range(per):
            a = _rows_below(dst, j, ch)
            assert a == swz(first + j, c, ch), (tid, j)
            written.setdefault(j, []).append((tid, a))
    flat = sorted(a for w in written.values() for _, a in w)
    rr, cc = np.meshgrid(np.arange(rows), np.arange(ch), indexing="ij")
    assert flat == sorted(swz(rr, cc, ch).ravel().tolist())
    if ch >= 8:
        for w in written.values():
            for q0 in range(0, threads, 8):
                assert len({int(bank_group(a)) for t, a in w if q0 <= t < q0 + 8}) == 8
