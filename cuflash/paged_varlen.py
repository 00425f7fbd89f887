"""Variable-length attention over paged K/V caches (attention_varlen(block_table=...), flash-attn 2's
flash_attn_varlen_func with a block_table: a serving engine's prefill of packed query chunks against
each sequence's cached keys): k and v are (num_pages, page_size, heads_kv, head_dim) pools, and
sequence b's key row r is row r % page_size of page block_table[b, r // page_size], its length
cu_seqlens_k[b + 1] - cu_seqlens_k[b] (or seqused_k[b]).

The pages are gathered into a padded packing first (sequence b at rows b x capacity .., capacity =
pages per sequence x page_size), which the varlen kernels read with the lengths as seqused_k
(cuflash/seqused.py), as the KV cache's chunked prefill gathers its pages (cuflash/kvcache.py): one
copy of the tables' pages, small beside a prefill chunk's attention. Forward only (as flash-attn's).
Host tables are checked (each entry a page of the pool); device ones are not, their entries clipped
into the pool (entries past a sequence's length may be anything).
"""
from __future__ import annotations

from . import kvcache, launch, problem


def gather(k, v, block_table, cu_seqlens_k, batch: int, device: int):
    """(k, v, cu_seqlens_k, lengths, capacity) of the padded packing of CuPy pools k, v and their table:
    the gathered rows (batch x capacity, heads_kv, head_dim), offsets b x capacity, and the key
    lengths from cu_seqlens_k (int32, on the device)."""
    import cupy

    infos = [problem.describe(x, n) for x, n in ((k, "k"), (v, "v"))]
    for info, name in zip(infos, ("k", "v")):
        if len(info.shape) != 4:
            raise ValueError(f"{name} must be (num_pages, page_size, heads_kv, head_dim) with block_table, got shape "
                             f"{info.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same (num_pages, page_size, heads_kv), got shapes {k.shape} and "
                         f"{v.shape}")
    n_pages, page = k.shape[:2]
    if page == 0:
        raise ValueError("page_size (k.shape[1]) must be at least 1")
    table = kvcache.checked_block_table(block_table, batch, n_pages, device)
    if n_pages == 0 and table.shape[1]:
        raise ValueError("k and v hold no page, but block_table names pages")
    cap = table.shape[1] * page
    with launch.graph_temporaries():  # the gathered caches live only as long as the call
        pages = cupy.clip(table, 0, max(n_pages - 1, 0))
        kg, vg = (x[pages].reshape(batch * cap, *x.shape[2:]) for x in (k, v))
        offsets = cupy.arange(batch + 1, dtype=cupy.int32) * cap
        cu = cupy.ascontiguousarray(cu_seqlens_k.astype(cupy.int32, copy=False))
        lengths = cu[1:] - cu[:-1]
    return kg, vg, offsets, lengths, cap
