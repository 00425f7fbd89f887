"""Paged KV caches (attention_with_kvcache(block_table=...), issue 17): a contiguous cache scattered
into shuffled pages must give BITWISE the contiguous result on the decode kernel (the same rows in
the same order: only their addresses differ), and the contiguous result within FlashAttention's
rule on the gather path (more rows per K/V head than the decode tile). Page sizes 1, 16, 64, 100, 256;
lengths 0, 1, page boundaries +-1 and the capacity; n_new appended into the pages (checked row by
row against the contiguous append); host and device tables; split-KV; GQA; torch."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import families, kvcache
from cuflash.families.sm80 import DECODE_PAGED_TILES
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule

pytestmark = pytest.mark.gpu


def _table(rng, batch, cap, page_size):
    """A shuffled page table over a pool with spare pages: (table int32 (batch, pages per seq), pool size)."""
    per = -(-cap // page_size)
    n_pages = batch * per + 3
    return rng.permutation(n_pages)[: batch * per].reshape(batch, per).astype(np.int32), n_pages


def _scatter(x, table, n_pages, page_size):
    """x (batch, cap, hk, d) written into the pages `table` names (the rest of the pool zero)."""
    import cupy

    b, cap, hk, d = x.shape
    per = table.shape[1]
    padded = cupy.zeros((b, per * page_size, hk, d), dtype=x.dtype)
    padded[:, :cap] = x
    pages = cupy.zeros((n_pages, page_size, hk, d), dtype=x.dtype)
    pages[cupy.asarray(table.reshape(-1))] = padded.reshape(b * per, page_size, hk, d)
    return pages


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 100, 256])
@pytest.mark.parametrize("h,hk,n_new", [(32, 8, 1), (8, 8, 0), (16, 2, 3), (8, 2, 9)])  # (8, 2, 9): the gather path
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("device_table", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_paged_equals_contiguous(num_splits, device_table, causal, h, hk, n_new, page_size, dtype, monkeypatch):
    import cupy

    from cuflash import families

    # the decode tile the paged call runs (paged calls may take a wider one than contiguous calls:
    # families/sm80.py _decode_paged_tile): the bitwise reference is the contiguous cache on it
    # (plans prepared by an earlier test of the same shapes, e.g. its host-table twin, would skip the
    # selection and leave no tile to compare on: none are kept)
    chosen, select = [], families.select
    monkeypatch.setattr(families, "select", lambda fam, p: chosen.append(select(fam, p)) or chosen[-1])
    kvcache._plans.clear()

    rng = np.random.default_rng(hash((num_splits, device_table, causal, h, hk, n_new, page_size, dtype)) % 2**32)
    d, cap = 128, 600
    lens = np.array([0, 1, page_size - 1, page_size, min(page_size + 1, cap - n_new), cap - n_new])
    batch, nq = len(lens), max(n_new, 1)
    dt = dtype_of(dtype)
    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt)
    q, kc, vc = mk(batch, nq, h, d), mk(batch, cap, hk, d), mk(batch, cap, hk, d)
    kn, vn = (mk(batch, n_new, hk, d), mk(batch, n_new, hk, d)) if n_new else (None, None)
    table, n_pages = _table(rng, batch, cap, page_size)
    kp, vp = _scatter(kc, table, n_pages, page_size), _scatter(vc, table, n_pages, page_size)
    mask = MaskOptions.of(causal=causal)
    kw = dict(cache_seqlens=lens, k_new=kn, v_new=vn, causal=causal, return_lse=True, num_splits=num_splits)
    tab = cupy.asarray(table) if device_table else table
    out, lse = kvcache.attention_with_kvcache(q, kp, vp, block_table=tab, **kw)
    tile = chosen[-1] if chosen else None
    ref, ref_lse = kvcache.attention_with_kvcache(q, kc, vc, **kw)  # appends into the contiguous copy too
    gather = (h // hk) * nq > 16
    same_tile = ref
    if not gather and num_splits and tile is not None:  # the append again writes the same rows
        same_tile, _ = kvcache._forward_cupy(q, kc, vc, lens, kn, vn, mask, None, num_splits=num_splits, config=tile)
    # the appended rows landed in the right page slots
    for b, n in enumerate(lens):
        for t in range(n_new):
            row = n + t
            page, slot = table[b, row // page_size], row % page_size
            assert bool((kp[page, slot].view(cupy.uint16) == kc[b, row].view(cupy.uint16)).all())
            assert bool((vp[page, slot].view(cupy.uint16) == vc[b, row].view(cupy.uint16)).all())
    for b, n in enumerate(lens + n_new):
        if n == 0:
            assert bool((out[b].astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse[b]).all())
            continue
        if not gather and num_splits:  # the same kernel and tile on the same rows (the heuristic may split differently)
            assert bool((out[b].view(cupy.uint16) == same_tile[b].view(cupy.uint16)).all()), f"batch {b}: not bitwise"
        err, pt, allowed = fa_rule(out[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], mask, 1 / math.sqrt(d))
        assert err <= allowed, f"batch {b} (length {n}): {err:.3e} > {allowed:.3e}"
        assert float(cupy.abs(lse[b] - ref_lse[b]).max()) <= 1e-4


def test_paged_through_torch_and_flash_attn_interface(monkeypatch):
    torch = pytest.importorskip("torch")
    from cuflash import families
    from cuflash import flash_attn_interface as fai

    # the contiguous reference runs the paged call's decode tile (16-row pages at d64 take 4 warps,
    # contiguous caches the 8-warp default: families/sm80.py _decode_paged_tile), so the two agree
    # bitwise; no plan kept from an earlier test skips the selection
    pinned, select = [], families.select

    def pick(fam, p):
        if fam is not families.DECODE:
            return select(fam, p)
        if not pinned:
            pinned.append(select(fam, p))
        return pinned[0]

    monkeypatch.setattr(families, "select", pick)
    kvcache._plans.clear()

    g = torch.Generator(device="cuda").manual_seed(0)
    b, cap, hk, h, d, page = 3, 256, 2, 8, 64, 16
    kc = torch.randn(b, cap, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(b, cap, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(b * cap // page, device="cuda", generator=g).to(torch.int32).reshape(b, cap // page)
    kp = torch.empty(b * cap // page, page, hk, d, device="cuda", dtype=torch.bfloat16)
    vp = torch.empty_like(kp)
    kp[table.reshape(-1).long()] = kc.reshape(-1, page, hk, d)
    vp[table.reshape(-1).long()] = vc.reshape(-1, page, hk, d)
    lens = torch.tensor([0, 100, cap], device="cuda", dtype=torch.int32)
    out = fai.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, causal=True)
    ref = fai.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
    kvcache._plans.clear()  # the contiguous plan on the pinned tile is not for later tests
    assert pinned, "the paged call's plan was prepared before this test (no selection seen)"
    assert torch.equal(out, ref)


def test_small_pages_take_the_wide_decode_tile(monkeypatch):
    """A paged cache of 16-row pages at d128 runs the 8-warp tile (families/sm80.py _decode_paged_tile)
    where it fits (nothing tuned applying); it agrees with the float64 reference by the 2x rule and
    with the contiguous cache's result."""
    import cupy

    from cuflash import _tuned, device, families
    from cuflash.families.sm80 import DECODE_PAGED_TILES

    monkeypatch.setattr(_tuned, "lookup", lambda fam, p, props: None)  # the rule acts on the default only
    # (plans prepared by an earlier test of the same shapes, e.g. its host-table twin, would skip the
    # selection and leave no tile to compare on: none are kept)
    chosen, select = [], families.select
    monkeypatch.setattr(families, "select", lambda fam, p: chosen.append(select(fam, p)) or chosen[-1])
    kvcache._plans.clear()
    rng = np.random.default_rng(7)
    b, cap, hk, h, d, page = 2, 512, 8, 32, 128, 16
    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(cupy.float16)
    q, kc, vc = mk(b, 1, h, d), mk(b, cap, hk, d), mk(b, cap, hk, d)
    table, n_pages = _table(rng, b, cap, page)
    kp, vp = _scatter(kc, table, n_pages, page), _scatter(vc, table, n_pages, page)
    lens = np.array([cap, 300])
    out = kvcache.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=cupy.asarray(table))
    props = device.supported(0)
    wide = next((t for t in DECODE_PAGED_TILES[(d, True)] if t.smem_bytes <= props.smem_optin), None)
    assert chosen, "the call's plan was prepared before this test (no selection seen)"
    if wide is not None and b * hk < 2 * props.sm_count:
        assert (chosen[-1].warps, chosen[-1].stages) == (wide.warps, wide.stages), chosen
    ref = kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    for i, n in enumerate(lens):
        err, _, allowed = fa_rule(out[i:i + 1], q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], MaskOptions.of(),
                                  1 / math.sqrt(d))
        assert err <= allowed, f"batch {i}: {err:.3e} > {allowed:.3e}"
    assert float(cupy.abs(out.astype(cupy.float32) - ref.astype(cupy.float32)).max()) < 1e-2


GROUPED_PAGE_TILES = sorted({*families.DECODE.selectable(), *(t for ts in DECODE_PAGED_TILES.values() for t in ts)})


def _rows_per_thread(tile):
    """RowGroupTileCopy::kRowsPer: the consecutive rows one thread copies (0 where THREADS % CH != 0)."""
    chunks = tile.head_dim // 8
    groups = tile.threads // chunks if tile.threads % chunks == 0 else 0
    return tile.block_k // groups if groups and tile.block_k % groups == 0 else 0


@pytest.mark.parametrize("tile", GROUPED_PAGE_TILES, ids=str)
@pytest.mark.parametrize("pages", ["1 group", "3 groups", "4 tiles"])
def test_pages_of_whole_row_groups_equal_contiguous(tile, pages):
    """Pages of a multiple of the rows one copying thread takes (sm80/decode.cuh GROUPED_PAGES:
    RowGroupTileCopy, one page lookup a thread and tile; d96 and d192, whose rows the threads do not
    divide, walk their pages): bitwise the contiguous cache's result on the same tile and split
    count, with pages of one thread's rows, of three (page edges inside a tile, between threads'
    runs), and of four tiles; lengths ending inside a tile, on a page boundary and at the capacity; split and
    unsplit."""
    import cupy

    rng = np.random.default_rng(tile.head_dim * 100 + tile.warps * 10 + tile.stages + len(pages))
    d, rows = tile.head_dim, _rows_per_thread(tile) or 8
    n, unit = pages.split(" ")
    page = int(n) * (rows if unit.startswith("group") else tile.block_k)
    cap = 3 * tile.block_k + 3 * page + 5
    lens = np.array([1, tile.block_k - 1, page, page + 1, cap])
    b, h, hk = len(lens), 8, 2
    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype_of("bfloat16"))  # noqa: E731
    q, kc, vc = mk(b, 1, h, d), mk(b, cap, hk, d), mk(b, cap, hk, d)
    table, n_pages = _table(rng, b, cap, page)
    kp, vp = _scatter(kc, table, n_pages, page), _scatter(vc, table, n_pages, page)
    for splits in (1, 3):
        kw = dict(num_splits=splits, config=tile)
        out, lse = kvcache._forward_cupy(q, kp, vp, lens, None, None, MaskOptions.of(), None,
                                         block_table=cupy.asarray(table), **kw)
        ref, ref_lse = kvcache._forward_cupy(q, kc, vc, lens, None, None, MaskOptions.of(), None, **kw)
        assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all()), f"{splits} splits: not bitwise"
        assert bool((lse == ref_lse).all())
    err, _, allowed = fa_rule(out[-1:], q[-1:], kc[-1:], vc[-1:], MaskOptions.of(), 1 / math.sqrt(d))
    assert err <= allowed
