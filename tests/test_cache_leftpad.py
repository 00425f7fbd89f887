"""cache_leftpad on the host (cuflash/cache_leftpad.py): the one-row pages' strides for the layouts
caches come in (contiguous, a slice of a longer cache, Hugging Face's transposed cache, pages), the
row table's rule, and the checks that run before anything is launched."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import cache_leftpad as lp


def _addresses(shape, strides):
    """Element offset of row (unit u, row i), as an array (units, rows)."""
    u, i = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    return u * strides[0] + i * strides[1]


@pytest.mark.parametrize("layout", ["contiguous", "slice", "transposed", "pages", "one_unit", "one_row"])
def test_row_pages_address_each_row(layout):
    """Row page (u s0 + i s1) starts where row (u, i) starts (g elements per page): the view reads
    every row of the cache, and rows of different positions are different pages."""
    b, s, hk, d = 3, 40, 4, 16
    item = 2
    if layout == "contiguous":
        x = np.zeros((b, s, hk, d), dtype=np.float16)
    elif layout == "slice":  # the first 40 rows of a 64-row cache
        x = np.zeros((b, 64, hk, d), dtype=np.float16)[:, :s]
    elif layout == "transposed":  # (batch, heads, seq, dim) seen as (batch, seq, heads, dim)
        x = np.zeros((b, hk, s, d), dtype=np.float16).transpose(0, 2, 1, 3)
    elif layout == "pages":
        x = np.zeros((11, 16, hk, d), dtype=np.float16)
    elif layout == "one_unit":
        x = np.zeros((1, s, hk, d), dtype=np.float16)
    else:
        x = np.zeros((b, 1, hk, d), dtype=np.float16)
    g, s0, s1, rows = lp.row_strides(x.shape, x.strides, item, "k_cache")
    addr = _addresses(x.shape, [st // item for st in x.strides])
    pages = np.arange(x.shape[0])[:, None] * s0 + np.arange(x.shape[1])[None] * s1
    assert np.array_equal(pages * g, addr)
    assert len(np.unique(pages)) == pages.size  # each row its own page
    assert pages.max() == rows - 1  # the view ends at the last row: it stays inside the cache
    # the view's last page, its last head's last element, is the cache's last element
    last = (rows - 1) * g + (hk - 1) * x.strides[2] // item + d - 1
    assert last == addr.max() + (hk - 1) * x.strides[2] // item + d - 1


def test_negative_strides_are_refused():
    x = np.zeros((2, 8, 1, 16), dtype=np.float16)[:, ::-1]
    with pytest.raises(ValueError, match="cache_leftpad: k_cache needs non-negative strides"):
        lp.row_strides(x.shape, x.strides, 2, "k_cache")


def test_too_many_row_positions_are_refused():
    with pytest.raises(ValueError, match="more than an int32 table holds"):
        lp.row_strides((2**20, 2**12, 1, 8), (2**12 * 16, 16, 16, 2), 2, "v_cache")


@pytest.mark.parametrize("paged", [False, True])
def test_row_table_rule(paged):
    """Entry j of batch b is row pad + j of its sequence (clipped into the width), found through the
    block table for pages."""
    pads = np.array([0, 3, 17])
    if paged:
        page, table = 8, np.array([[4, 1, 0], [2, 5, 3], [7, 6, 8]])
        width, s0, s1 = 24, 8, 1
    else:
        page, table, width, s0, s1 = 20, None, 20, 20, 1
    rows = lp.host_rows(table, pads, width, page, s0, s1)
    for b, pad in enumerate(pads):
        for j in range(width):
            r = min(pad + j, width - 1)
            unit = b if table is None else table[b, r // page]
            assert rows[b, j] == unit * s0 + (r % page) * s1


def _arrays(batch=3, cap=32, hk=2, d=16):
    q = np.zeros((batch, 1, 4, d), dtype=np.float16)
    cache = np.zeros((batch, cap, hk, d), dtype=np.float16)
    return q, cache


@pytest.mark.parametrize("pads,lens,n_new,match", [
    ([0, 5, 3], [4, 4, 9], 0, r"cache_leftpad\[1\] = 5 is past cache_seqlens\[1\] = 4"),
    ([0, -1, 3], [4, 4, 9], 0, r"cache_leftpad\[1\] = -1: lengths must be >= 0"),
    ([0, 1], [4, 4, 9], 0, r"cache_leftpad must be integers of shape \(batch=3,\)"),
    ([0.5, 1, 2], [4, 4, 9], 0, r"cache_leftpad must be integers"),
    ([0, 1, 2], [4, 4, 31], 2, r"cache_seqlens\[2\] = 31: with n_new = 2"),
    ([0, 1, 2], 31, 2, r"cache_seqlens\[0\] = 31: with n_new = 2"),
])
def test_host_pads_and_lengths_are_checked_before_any_launch(pads, lens, n_new, match):
    q, cache = _arrays()
    with pytest.raises(ValueError, match=match):
        lp.as_rows(pads, q, cache, cache, None, lens, n_new)


def test_k_and_v_laid_out_differently_are_refused():
    pytest.importorskip("cupy")
    q, k = _arrays()
    v = np.zeros((3, 2, 32, 16), dtype=np.float16).transpose(0, 2, 1, 3)
    with pytest.raises(ValueError, match="k_cache and v_cache must be laid out alike"):
        lp.as_rows([0, 1, 2], q, k, v, None, [4, 4, 4], 0)
