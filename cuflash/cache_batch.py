"""`cache_batch_idx` (FlashAttention's flash_attn_with_kvcache argument): batch b of q attends to,
and appends into, sequence cache_batch_idx[b] of a contiguous cache (batch_cache, capacity,
heads_kv, head_dim), so that a serving loop keeps one pool of cache sequences and picks its rows per
step without copying them.

No kernel of its own: such a cache already is a paged cache whose pages are its sequences
(page_size = capacity, page i = sequence i: the same array, nothing copied), and
cache_batch_idx[:, None] is its block table. The paged path of cuflash/kvcache.py does the rest: the
decode kernel reads the pages in place, longer chunks gather them, k_new / v_new are appended
through the table. The decode kernel addresses a page's rows in 32 bits
(kvcache.page_layout_problem): a sequence of 2^31 elements or more is cut into `per` equal pages
(a strided view, still no copy; page per * i + j is part j of sequence i), which needs its rows
evenly strided across the sequences (batch stride = capacity x row stride, as in any C-ordered
cache).
"""
from __future__ import annotations

import numpy as np

from . import kvcache, launch, problem, staging


def _cut_fits(info: problem.ArrayInfo, per: int) -> bool:
    """Whether the decode kernel can address the pages of a cache (ArrayInfo of (batch_cache,
    capacity, heads_kv, head_dim)) whose sequences are cut into `per` equal pages."""
    bc, cap, hk, d = info.shape
    if per == 1:
        return kvcache.page_layout_problem(info.shape, info.strides, info.itemsize) is None
    s = info.strides
    if min(s) < 0 or s[0] != cap * s[1]:  # the pages of one sequence must follow each other
        return False
    page = cap // per
    return kvcache.page_layout_problem((bc * per, page, hk, d), (page * s[1], *s[1:]), info.itemsize) is None


def pages_per_sequence(infos: list) -> int | None:
    """Into how many equal pages the sequences of the caches (ArrayInfos of one shape) are cut: 1 when
    a whole sequence is a page the decode kernel can address, else the fewest that are; None when no
    cut is (strides negative, or sequences not laid end to end)."""
    cap = infos[0].shape[1]
    for per in range(1, cap + 1):
        if cap % per == 0 and all(_cut_fits(i, per) for i in infos):
            return per
    return None


def host_table(cache_batch_idx, batch: int, batch_cache: int, per: int) -> np.ndarray:
    """The block table (batch, per) int32 of host indices, checked: integers, one per batch of q, each
    a sequence of the cache."""
    idx = np.asarray(cache_batch_idx)
    if idx.dtype.kind not in "iu" or idx.shape != (batch,):
        raise ValueError(f"cache_batch_idx must be integers of shape (batch={batch},), got {idx.dtype} {idx.shape}")
    bad = np.flatnonzero((idx < 0) | (idx >= batch_cache))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"cache_batch_idx[{i}] = {int(idx[i])} is not a sequence of the cache "
                         f"(k_cache has {batch_cache})")
    return (idx.astype(np.int64)[:, None] * per + np.arange(per)).astype(np.int32)


def _device_table(cache_batch_idx, batch: int, device: int, per: int):
    """The block table (batch, per) int32 on the device (a view of int32 indices when per is 1), checked
    for shape, dtype and device only: reading the values would synchronise."""
    import cupy

    idx = cache_batch_idx
    if idx.dtype.kind not in "iu" or idx.shape != (batch,):
        raise ValueError(f"cache_batch_idx must be an integer array of shape (batch={batch},), got "
                         f"{idx.dtype} {idx.shape}")
    if idx.device.id != device:
        raise ValueError(f"cache_batch_idx is on device {idx.device.id}, q on {device}")
    with launch.graph_temporaries():  # (a converted or widened table lives only as long as the call)
        table = idx.astype(cupy.int32, copy=False).reshape(batch, 1)
        if per > 1:
            table = table * per + cupy.arange(per, dtype=cupy.int32)
    return table


def as_paged(cache_batch_idx, q, k_cache, v_cache):
    """(k_pages, v_pages, block_table) for kvcache's paged path: the CuPy caches as pages (themselves,
    or a strided view of them), and the table on the device from cache_batch_idx (NumPy / integers
    on the host: checked, then copied; a CuPy array: not checked). A cache of capacity 0 holds no
    page: (batch, 0, heads_kv, head_dim) stand-ins and no table then (nothing is read or written)."""
    import cupy

    infos = [problem.describe(x, n) for x, n in ((k_cache, "k_cache"), (v_cache, "v_cache"))]
    for info, name in zip(infos, ("k_cache", "v_cache")):
        if len(info.shape) != 4:
            raise ValueError(f"{name} must be (batch_cache, capacity, heads_kv, head_dim) with cache_batch_idx, "
                             f"got shape {info.shape}")
    if infos[0].shape != infos[1].shape:
        raise ValueError(f"k_cache and v_cache must have one shape (batch_cache, capacity, heads_kv, head_dim), "
                         f"got {infos[0].shape} and {infos[1].shape}")
    q_info = problem.describe(q, "q")
    if len(q_info.shape) != 4:
        raise ValueError(f"q must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {q_info.shape}")
    batch = q_info.shape[0]
    bc, cap, hk, d = infos[0].shape
    on_device = isinstance(cache_batch_idx, cupy.ndarray)
    if cap == 0:
        if on_device:
            _device_table(cache_batch_idx, batch, q_info.device, 1)
        else:
            host_table(cache_batch_idx, batch, bc, 1)
        return tuple(cupy.empty((batch, 0, hk, d), dtype=c.dtype) for c in (k_cache, v_cache)) + (None,)
    per = pages_per_sequence(infos)
    if per is None:
        raise ValueError(f"cache_batch_idx: the sequences of k_cache / v_cache (capacity {cap}, strides "
                         f"{infos[0].strides} / {infos[1].strides} bytes) span 2^31 elements or more and cannot "
                         f"be cut into pages (their rows are not evenly strided across sequences)")
    pages = tuple(c if per == 1 else cupy.lib.stride_tricks.as_strided(
        c, (bc * per, cap // per, hk, d), (cap // per * c.strides[1], *c.strides[1:])) for c in (k_cache, v_cache))
    if on_device:
        table = _device_table(cache_batch_idx, batch, q_info.device, per)
    else:  # checked here, so copied here (a capture's error then names this argument)
        table = staging.upload(host_table(cache_batch_idx, batch, bc, per), "cache_batch_idx")
    return (*pages, table)
