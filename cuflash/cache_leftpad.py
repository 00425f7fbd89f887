"""`cache_leftpad` (FlashAttention's flash_attn_with_kvcache argument): batch b's keys start at row
cache_leftpad[b] of its cache sequence instead of row 0. It attends to rows [cache_leftpad[b],
cache_seqlens[b] + n_new); k_new / v_new are appended at row cache_seqlens[b]; rotary positions
count from row 0 as without a pad (FlashAttention's convention: the pad moves nothing but the first
key). Left-padded batches (Hugging Face's generate() pads prompts on the left) decode in place.

No kernel of its own: every row of the cache becomes a page of one row (`row_view`: a strided view
of the same memory, nothing copied) and a table built on the device per call (`row_table`) lists
batch b's rows from its pad on. The paged path of cuflash/kvcache.py then attends to the first
cache_seqlens[b] - cache_leftpad[b] (+ n_new) rows of that table: causal, windows and ALiBi are
aligned to the batch's last key, so they are the same whether the keys start at row 0 or at the pad.

A row's page index is its element offset divided by g, the gcd of the cache's two outer strides:
(batch / page u, row i) -> (u * s0 + i * s1) / g. Contiguous caches give u * capacity + i; a cache
seen through a transpose (Hugging Face's (batch, heads, seq, dim) as (batch, seq, heads, dim)) gives
pages that overlap in memory (each a row of one position, its heads further on), which the kernels
only read and the append writes through the view's strides. k_cache and v_cache need the same outer
strides (one table addresses both).
"""
from __future__ import annotations

import math

import numpy as np

from . import launch, seqused, staging

_ROWS = None


def _row_kernel():
    global _ROWS
    if _ROWS is None:
        import cupy

        # rows (batch, width): entry j of batch b is the row page of its row r = pad + j (clipped into the
        # width: entries past a batch's rows are never attended, and an append that reaches them is past
        # the cache's capacity), in unit u (its block-table entry, or the batch itself without a table)
        _ROWS = cupy.ElementwiseKernel(
            "raw int32 table, raw int32 pads, int32 width, int32 table_stride, int32 page, int64 s0, int64 s1, "
            "int32 has_table",
            "int32 rows",
            """
            const long long b = i / width;
            const int r = min(max(pads[b] + (int)(i % width), 0), width - 1);
            const long long u = has_table ? (long long)table[b * table_stride + r / page] : b;
            rows = (int)(u * s0 + (long long)(r % page) * s1);
            """,
            "cuflash_cache_leftpad_rows")
    return _ROWS


def row_strides(shape: tuple, strides: tuple, itemsize: int, name: str) -> tuple:
    """(g, s0 / g, s1 / g, rows) for a cache of `shape` (units, rows per unit, heads_kv, head_dim) and
    byte `strides`: the row pages' stride g in elements, the unit and row strides in pages, and how
    many row pages the view has; ValueError naming `name` where the rows cannot be pages."""
    n, per = shape[:2]
    s0, s1 = (s // itemsize for s in strides[:2])
    if (n > 1 and s0 < 0) or (per > 1 and s1 < 0):
        raise ValueError(f"cache_leftpad: {name} needs non-negative strides along its first two axes, got "
                         f"{tuple(strides)} bytes")
    s0, s1 = (s0 if n > 1 else 0), (s1 if per > 1 else 0)
    g = math.gcd(s0, s1) or 1
    rows = ((n - 1) * s0 + (per - 1) * s1) // g + 1 if n and per else 0
    if rows >= 2**31:
        raise ValueError(f"cache_leftpad: {name} has {rows} row positions, more than an int32 table holds")
    return g, s0 // g, s1 // g, rows


def row_view(cache, g: int, rows: int):
    """The cache (units, rows per unit, heads_kv, head_dim) as `rows` pages of one row each."""
    import cupy

    st = cache.strides
    return cupy.lib.stride_tricks.as_strided(cache, (rows, 1, *cache.shape[2:]),
                                            (g * cache.itemsize, st[1], *st[2:]))


def host_rows(table, pads, width: int, page: int, s0: int, s1: int) -> np.ndarray:
    """row_table's rule in NumPy (the tests' oracle): table (batch, cols) or None, pads (batch,)."""
    pads = np.asarray(pads, dtype=np.int64)
    r = np.clip(pads[:, None] + np.arange(width), 0, width - 1)
    u = np.arange(len(pads))[:, None] if table is None else np.take_along_axis(np.asarray(table), r // page, 1)
    return (u * s0 + (r % page) * s1).astype(np.int32)


def _host_pads(cache_leftpad, batch: int):
    """Host pads as int64 (batch,), checked; None for a CuPy array (its values are not read)."""
    import cupy

    if isinstance(cache_leftpad, cupy.ndarray):
        return None
    return seqused.host_lengths(cache_leftpad, "cache_leftpad", batch).astype(np.int64)


def _check_host(pads, lens, n_new: int, width: int) -> None:
    """Host pads against host lengths: a pad past its batch's length, or rows past the capacity."""
    bad = np.flatnonzero(pads > lens)
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"cache_leftpad[{b}] = {int(pads[b])} is past cache_seqlens[{b}] = {int(lens[b])}: a "
                         f"batch's keys are rows cache_leftpad .. cache_seqlens (+ n_new) of its cache")
    bad = np.flatnonzero((lens < 0) | (lens + n_new > width))
    if bad.size:
        from .kvcache import _lengths_do_not_fit

        _lengths_do_not_fit(int(bad[0]), int(lens[bad[0]]), n_new, width)


def _on_device(x, batch: int, name: str, device: int):
    """Integers (an int, host ones, a CuPy array) as a CuPy int32 (batch,) array."""
    if type(x) is int or isinstance(x, np.integer):
        x = np.full(batch, int(x), dtype=np.int64)
    return seqused.device_lengths(x, name, batch, device)


def as_rows(cache_leftpad, q, k_cache, v_cache, table, cache_seqlens, n_new: int):
    """(k_rows, v_rows, row table, shifted lengths) for kvcache's paged path: k_cache / v_cache
    (batch, capacity, heads_kv, head_dim) with table None, or pages (num_pages, page_size, ...) with
    their block table (a checked CuPy int32 array); the lengths the table's view sees
    (cache_seqlens - cache_leftpad: host integers where both are on the host, else a CuPy array).
    Host pads and lengths are checked (each pad at most its batch's length, the appended rows within
    the capacity); device ones are not: a pad past its length attends to no key and appends nothing."""
    import cupy

    batch = q.shape[0]
    pads = _host_pads(cache_leftpad, batch)
    page = k_cache.shape[1]
    width = page if table is None else table.shape[1] * page  # the rows a batch sees
    from .kvcache import _host_lengths

    host_lens = _host_lengths(cache_seqlens, batch)
    if pads is not None and host_lens is not None:
        _check_host(pads, host_lens, n_new, width)
    elif host_lens is not None:
        _check_host(np.zeros(batch, dtype=np.int64), host_lens, n_new, width)
    if width == 0:  # no row to read or write (the pads were checked as integers)
        return k_cache, v_cache, table, cache_seqlens
    strides = [row_strides(c.shape, c.strides, c.itemsize, n) for c, n in ((k_cache, "k_cache"), (v_cache, "v_cache"))]
    if strides[0][1:3] != strides[1][1:3]:
        raise ValueError(f"cache_leftpad: k_cache and v_cache must be laid out alike along their first two axes "
                         f"(one table addresses both), got strides {k_cache.strides} and {v_cache.strides} bytes")
    k_rows, v_rows = (row_view(c, g, rows) for c, (g, _, _, rows) in zip((k_cache, v_cache), strides))
    _, s0, s1, _ = strides[0]
    dev = q.device.id
    if pads is not None and host_lens is not None:
        shifted = host_lens - pads
        pads_dev = staging.upload(pads.astype(np.int32), "cache_leftpad")
    else:
        pads_dev = _on_device(cache_leftpad if pads is None else pads, batch, "cache_leftpad", dev)
        lens_dev = _on_device(cache_seqlens, batch, "cache_seqlens", dev)
        with launch.graph_temporaries():
            shifted = lens_dev - pads_dev
    with launch.graph_temporaries():  # the row table lives only as long as the call
        rows = cupy.empty((batch, width), dtype=cupy.int32)
        stand_in = pads_dev if table is None else table  # (not read without a table)
        t_stride = 0 if table is None else table.strides[0] // 4
        _row_kernel()(stand_in, pads_dev, np.int32(width), np.int32(t_stride), np.int32(page), np.int64(s0),
                      np.int64(s1), np.int32(table is not None), rows)
    return k_rows, v_rows, rows, shifted
