"""The KV-cache forward without a GPU (issue 17, contiguous caches): the per-batch-length reference
against per-batch slicing of attention_naive, the seqused_k kernel instances (compile on sm_80 and
sm_90a without spills; the families that have them), argument checks that need no device."""
from __future__ import annotations

import re
import types

import numpy as np
import pytest

from cuflash import _compile, families, kvcache, launch, reference
from cuflash.families.sm80 import DECODE_PAGED_TILES, _decode_paged_tile
from cuflash.features import Features
from cuflash.mask import MaskOptions
from cuflash.tiles import DecodeConfig
from tests.test_compile import _nvrtc_available
from tests.test_compile_v1 import _ptx

needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")

MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 0)), (True, (5, -1)), (False, (2, 4)), (False, (0, 0))]


@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("nq", [1, 4, 9])
def test_reference_equals_per_batch_slices(causal, window, nq):
    rng = np.random.default_rng(nq)
    b, cap, h, hk, d = 5, 23, 4, 2, 16
    q = rng.standard_normal((b, nq, h, d))
    kc, vc = rng.standard_normal((2, b, cap, hk, d))
    lens = [0, 1, nq, 11, cap]
    kc[1, 1:], vc[1, 1:] = np.nan, np.nan  # rows past a length are never read
    out, lse = reference.attention_kvcache(q, kc, vc, lens, causal=causal, window_size=window, softcap=0.0)
    assert np.isfinite(out).all()
    for i, n in enumerate(lens):
        if n == 0:
            assert (out[i] == 0).all() and np.isneginf(lse[i]).all()
            continue
        o, l = reference.attention_naive(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], causal=causal, window_size=window)
        np.testing.assert_allclose(out[i], o[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse[i]), np.isneginf(l[0]))
        np.testing.assert_allclose(lse[i][np.isfinite(l[0])], l[0][np.isfinite(l[0])], rtol=1e-12)


def test_reference_append_then_attend_is_attention_to_the_concatenation():
    rng = np.random.default_rng(7)
    b, cap, h, d, n_new = 3, 20, 2, 8, 4
    q = rng.standard_normal((b, n_new, h, d))
    kc, vc = rng.standard_normal((2, b, cap, h, d))
    kn, vn = rng.standard_normal((2, b, n_new, h, d))
    lens = np.array([0, 5, cap - n_new])
    for i, n in enumerate(lens):
        kc[i, n:n + n_new], vc[i, n:n + n_new] = kn[i], vn[i]
    out, _ = reference.attention_kvcache(q, kc, vc, lens + n_new, causal=True)
    for i, n in enumerate(lens):
        kcat = np.concatenate([kc[i:i + 1, :n], kn[i:i + 1]], axis=1)
        vcat = np.concatenate([vc[i:i + 1, :n], vn[i:i + 1]], axis=1)
        o, _ = reference.attention_naive(q[i:i + 1], kcat, vcat, causal=True)
        np.testing.assert_allclose(out[i], o[0], rtol=1e-12, atol=1e-12)


def test_reference_rejects_lengths_out_of_range():
    q, kc = np.zeros((2, 1, 1, 8)), np.zeros((2, 4, 1, 8))
    for lens in ([0, 5], [-1, 0], [1]):
        with pytest.raises(ValueError, match="cache_seqlens"):
            reference.attention_kvcache(q, kc, kc, lens)


def test_only_the_sm80_forward_has_seqused_k_instances():
    f = Features("bfloat16", 64, seqused_k=True)
    assert f.tag() == "_kvlen" and f.perf_class() == "dense"
    assert f.cxx() == "cuflash::Variant<false, false, false, false, true, false, false, false, false, false, false, false, false>"
    assert [fam.name for fam in families.REGISTRY.values() if fam.supports(f)] == ["fwd", "decode"]
    for fam in families.FORWARDS:
        if fam is not families.FWD:
            assert "per-batch key lengths" in fam._unsupported_part(f)


def test_shell_takes_seqused_k_after_the_data_pointers():
    tile = families.FWD.default(64)
    plain = _compile.kernel_source(tile, Features("float16", 64))
    kv = _compile.kernel_source(tile, Features("float16", 64, seqused_k=True))
    assert "int* __restrict__ seqused_k" not in plain and "(q, k, v, out, lse, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, p);" in plain
    assert "float* __restrict__ lse, const int* __restrict__ seqused_k," in kv
    assert "(q, k, v, out, lse, seqused_k, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, p);" in kv


def test_host_lengths():
    assert kvcache._host_lengths(3, 2).tolist() == [3, 3]
    assert kvcache._host_lengths([1, 2], 2).tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        kvcache._host_lengths([1, 2], 3)
    with pytest.raises(TypeError, match="integers"):
        kvcache._host_lengths([1.5, 2.0], 2)
    with pytest.raises(TypeError, match="cache_seqlens"):
        kvcache._host_lengths(True, 2)


def test_new_keys_and_values_come_together():
    with pytest.raises(ValueError, match="k_new and v_new"):
        kvcache.attention_with_kvcache(None, None, None, cache_seqlens=0, k_new=object())


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("local,softcap", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_seqused_k_instances_compile_without_spills(arch, d, local, softcap, dtype):
    f = Features(dtype, d, local=local, softcap=softcap, seqused_k=True)
    tile = families.FWD.default(d, features=f)
    r = _compile.compile_report(_compile.kernel_source(tile, f), arch)
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (tile, r)


@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_plain_instances_compile_the_optional_code_out(d):
    """The forward's shell passes nullptr for the optional pointers an instance does not take
    (seqused_k, cu_seqlens, alibi_slopes; KernelFamily.nullable_pointers), and the code that would
    read them is compiled out, not merely unused: the plain instance's PTX loads none of the ALiBi
    parameters, which the ALiBi instance loads. (When the shells still called per-pointer-set
    overloads, the plain PTX was checked equal to the nullptr call's.)"""
    tile = families.FWD.default(d)
    plain = _ptx(_compile.kernel_source(tile, Features("bfloat16", d)), "sm_80")
    alibi_tile = families.FWD.default(d, features=Features("bfloat16", d, alibi=True))
    alibi = _ptx(_compile.kernel_source(alibi_tile, Features("bfloat16", d, alibi=True)), "sm_80")
    from cuflash import params

    names = [f for f, _ in params.fields("FwdParams")]
    def loaded(ptx, *fields):  # the struct's fields are the last parameters, in its order
        n = len(re.findall(r"\.param \.\w+ \w+_param_\d+", ptx))
        at = [n - len(names) + names.index(f) for f in fields]
        return [bool(re.search(rf"ld\.param\.\w+\s+%\w+, \[\w+_param_{i}\]", ptx)) for i in at]

    assert loaded(plain, "alibi_scale", "alibi_sb") == [False, False]
    assert loaded(alibi, "alibi_scale", "alibi_sb") == [True, True]
    assert loaded(plain, "bm_sb", "bm_sh", "bm_nb") == loaded(alibi, "bm_sb", "bm_sh", "bm_nb") == [False] * 3


@pytest.mark.parametrize("causal,window", MASKS)
def test_for_batch_geometry_is_the_geometry_of_the_batch_length(causal, window):
    """MaskGeometry::for_batch's rule (offset + len - capacity, seqlen_k = len), in Python: the
    geometry the host computes against the capacity, moved to a batch's length, is the geometry of
    a plain call with that many keys; and its visible set is the reference's."""
    from cuflash.mask import MaskOptions

    mask = MaskOptions.of(causal=causal, window_size=window)
    cap = 37
    for nq in (1, 5, 40):
        left, right, offset = mask.geometry(nq, cap)
        for n in (0, 1, 4, 36, 37):
            moved = (left, right, offset + (n - cap))
            assert moved == mask.geometry(nq, n)
            q = np.arange(nq)[:, None]
            k = np.arange(cap)[None, :]
            seen = (k >= q + moved[2] - left) & (k <= q + moved[2] + right) & (k < n)
            ref = reference.visible_per_batch(nq, cap, [n], causal, window)[0, 0]
            np.testing.assert_array_equal(seen, ref)


def test_num_splits_heuristic():
    h = kvcache.num_splits_heuristic
    assert h(200, 132, 64) == 1  # the work fills the GPU already
    assert h(8, 132, 1) == 1  # one key block: nothing to split
    assert h(8, 132, 64) == 16 and h(32, 132, 256) == 4  # ~one full wave
    for tiles in (1, 3, 8, 40):
        for blocks in (2, 5, 64, 1000):
            s = h(tiles, 132, blocks)
            assert 1 <= s <= min(kvcache.MAX_SPLITS, blocks)


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
def test_split_kv_instances_compile_without_spills(d, arch):
    """The KV cache's features (per-batch lengths, windows, softcap, a partial head dim) with split-KV
    on the default tile the family picks for them."""
    import itertools

    for local, softcap, partial in itertools.product((False, True), repeat=3):
        f = Features("bfloat16", d, seqused_k=True, split_kv=True, local=local, softcap=softcap, partial_d=partial)
        tile = families.FWD.default(d, features=f)
        r = _compile.compile_report(_compile.kernel_source(tile, f), arch)
        assert r["registers"] > 0 and r["spill_stores"] == 0, (tile, f, r["spill_stores"])


@pytest.mark.parametrize("bad", [-1, 129, 2.0, True, None, "4"])
def test_num_splits_is_checked(bad):
    with pytest.raises(ValueError, match="num_splits must be an int in"):
        kvcache.check_num_splits(bad)
    assert kvcache.check_num_splits(0) == 0 and kvcache.check_num_splits(128) == 128


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_reference(interleaved):
    """Rotations keep each pair's norm and the unrotated tail; position 0 (cos 1, sin 0) is the
    identity; the two pairings are each other's permutation of the features."""
    rng = np.random.default_rng(0)
    b, t, h, d, rd = 2, 5, 3, 16, 8
    x = rng.standard_normal((b, t, h, d))
    theta = rng.uniform(0, 6.3, (40, rd // 2))
    cos, sin = np.cos(theta), np.sin(theta)
    pos = rng.integers(1, 40, (b, t))
    y = reference.rotary(x, cos, sin, pos, interleaved=interleaved)
    pairs = ([(2 * i, 2 * i + 1) for i in range(rd // 2)] if interleaved else [(i, i + rd // 2) for i in range(rd // 2)])
    for i, j in pairs:
        np.testing.assert_allclose(x[..., i] ** 2 + x[..., j] ** 2, y[..., i] ** 2 + y[..., j] ** 2, rtol=1e-12)
    np.testing.assert_array_equal(y[..., rd:], x[..., rd:])
    np.testing.assert_allclose(reference.rotary(x, cos * 0 + 1, sin * 0, pos, interleaved=interleaved), x)
    if not interleaved:  # NeoX's pairs laid out side by side are GPT-J's
        perm = [p for pair in pairs for p in pair] + list(range(rd, d))
        other = reference.rotary(x[..., perm], cos, sin, pos, interleaved=True)
        np.testing.assert_allclose(other, y[..., perm])


def test_rotary_host_positions_past_the_tables_are_named():
    from cuflash import rotary

    assert rotary.host_positions_problem(np.array([3, 10]), 5, 15) is None  # positions up to 14
    why = rotary.host_positions_problem(np.array([3, 11]), 5, 15)
    assert "batch 1 needs position 15" in why and "15 positions" in why


def test_rotary_without_cache_seqlens_is_refused():
    from cuflash import flash_attn_interface as fai

    with pytest.raises(ValueError, match="rotary embedding needs cache_seqlens"):
        fai.flash_attn_with_kvcache(None, None, None, rotary_cos=object(), rotary_sin=object())


# ------------------------------------------------------------------ the decode kernel (families.DECODE)

# Decode instances allowed a few bytes of spill: (arch, head_dim, local, split_kv, softcap) of a paged
# instance -> bytes of spill stores and of stack frame, each at most. None since 2026-12-06: the d192
# windowed instances' 4-8 B (the next tile's page numbers held a tile ahead, decode.cuh PagedTileRows,
# tipping ptxas into a spill at 96-128 registers; sm_90a, and under NVRTC 13.0 sm_80 too) went with
# the 33rd session's decode changes (every instance compiled spill-free under NVRTC 13.0 and 13.5,
# 34th session). (The split d192 softcap instance's 16 B, from the in-kernel merge, had gone when the
# merge stopped being inlined into the mainloop's allocation: sm80/decode.cuh merge_splits.)
KNOWN_DECODE_SPILLS: dict = {}
# The same for contiguous caches, keyed alike. d32, 4 stages, softcap + split on sm_90a (NVRTC 13.0 and
# 13.5) since the contiguous copy's addressing (2026-12-06, sm80/tile_copy.cuh StridedTileCopy): ptxas
# settles at 64 registers and keeps one int (the lane's key column) on the stack, stored before the
# mainloop and loaded only in its masking branch (the partial last tile), once per block.
KNOWN_DECODE_SPILLS_CONTIGUOUS = {("sm_90a", 32, False, True, True): 8}


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("tile", sorted({*families.DECODE.selectable(), *(t for ts in DECODE_PAGED_TILES.values() for t in ts)}), ids=str)
def test_decode_instances_compile_without_spills(tile, arch):
    """Every selectable decode tile with each of the KV cache's feature sets (windows, softcap,
    split-KV, paged), both dtypes; spill-free but KNOWN_DECODE_SPILLS. The paged-only tiles
    (DECODE_PAGED_TILES, picked for paged calls alone) with the paged sets only."""
    import itertools

    pagings = (False, True) if tile in families.DECODE.selectable() else (True,)
    for local, softcap, split, paged, dtype in itertools.product((False, True), (False, True), (False, True),
                                                                 pagings, ("bfloat16", "float16")):
        f = Features(dtype, tile.head_dim, seqused_k=True, split_kv=split, local=local, softcap=softcap, paged=paged)
        r = _compile.compile_report(_compile.kernel_source(tile, f), arch)
        known = (KNOWN_DECODE_SPILLS if paged else KNOWN_DECODE_SPILLS_CONTIGUOUS).get((arch, tile.head_dim, local, split, softcap), 0)
        assert r["registers"] > 0 and r["spill_stores"] <= known and r["stack_bytes"] <= known, \
            (tile, f, r["spill_stores"])


@needs_nvrtc
@pytest.mark.parametrize("tile", families.DECODE.selectable(), ids=str)
def test_decode_smem_mirror(tile):
    """DecodeConfig.smem_bytes is Sm80DecodeTraits::kSmemBytes (a static_assert under NVRTC)."""
    from tests.test_params import check_smem_mirror

    check_smem_mirror("sm80/decode.cuh", f"cuflash::Sm80DecodeTraits<{tile.head_dim}, {tile.warps}, {tile.stages}>",
                      tile.smem_bytes)


def test_decode_family_takes_only_kv_cache_calls():
    f = families.DECODE
    assert f not in families.FORWARDS and not f.tuned_by_default
    assert f.supports(Features("bfloat16", 128, seqused_k=True)) and not f.supports(Features("bfloat16", 128))
    assert f.supports(Features("float16", 64, seqused_k=True, split_kv=True, local=True, softcap=True))
    assert not f.supports(Features("bfloat16", 128, seqused_k=True, dropout=True))
    assert not f.supports(Features("bfloat16", 128, seqused_k=True, partial_d=True))
    assert f.supports(Features("bfloat16", 256, seqused_k=True))  # two warps per key slice above d128
    assert [(t.block_k, t.col_splits) for t in f.defaults[256]] == [(32, 2), (32, 2)]
    assert [t.block_k for t in f.defaults[128]] == [64, 64]


def _kv_problem(batch, nq, h, hk, d, cap=300):
    import dataclasses

    from cuflash import problem
    from cuflash.mask import MaskOptions

    def info(shape):
        n = int(np.prod(shape))
        strides = tuple(int(np.prod(shape[i + 1:])) * 2 for i in range(len(shape)))
        return problem.ArrayInfo(tuple(shape), "bfloat16", 2, strides, 1 << 20, 0) if n else None

    p = problem.resolve_forward(info((batch, nq, h, d)), info((batch, cap, hk, d)), info((batch, cap, hk, d)),
                                MaskOptions.of(causal=True), None)
    return dataclasses.replace(p, seqused_k=True)


@pytest.mark.parametrize("nq,h,hk,d,why", [(1, 32, 8, 128, None), (4, 32, 8, 128, None), (5, 32, 8, 128, "20 rows"),
                                           (16, 4, 4, 64, None), (1, 32, 1, 64, "32 rows"),
                                           (1, 8, 8, 80, "head_dim 80"), (1, 8, 8, 256, None), (2, 8, 8, 192, None)])
def test_decode_problem(nq, h, hk, d, why):
    got = kvcache.decode_problem(_kv_problem(2, nq, h, hk, d))
    assert (got is None) if why is None else (why in got), got


def test_decode_splits():
    # the cells on an H200 (132 SMs, two w4s3 d128 blocks each: 264 slots, one per SM reads at
    # the copy rate): batch x K/V heads of work (scripts/sweep_decode_splits.py's best counts)
    assert kvcache.decode_splits(1 * 8, 2, 132, 131072 // 64) == 16  # 128 blocks, one per SM (29: 0.83x copy)
    assert kvcache.decode_splits(8 * 8, 2, 132, 8192 // 64) == 2
    assert kvcache.decode_splits(8 * 8, 2, 132, 32768 // 64) == 2
    assert kvcache.decode_splits(2 * 8, 2, 132, 65536 // 64) == 8
    assert kvcache.decode_splits(64 * 8, 2, 132, 8192 // 64) == 1  # the work alone fills the GPU
    assert kvcache.decode_splits(16 * 8, 2, 132, 4096 // 64) == 1
    assert kvcache.decode_splits(8, 2, 132, 8) == 2  # at least 4 key blocks per split
    assert kvcache.decode_splits(8, 2, 132, 7) == 1
    # two blocks per SM needed (2-stage rings): the quantum doubles, and several waves fill the slots
    assert kvcache.decode_splits(1 * 8, 3, 132, 131072 // 64, per_sm=2) == 32  # 256 blocks
    assert kvcache.decode_splits(8 * 8, 3, 132, 8192 // 64, per_sm=2) == 4
    assert kvcache.decode_splits(64 * 8, 3, 132, 8192 // 64, per_sm=2) == 3  # 1536 blocks, 3.9 waves of 396
    assert kvcache.decode_splits(0, 2, 132, 100) == 1


def test_decode_blocks_per_sm():
    # 64 KiB of K/V in flight per SM: (stages - 1) x 2 x block_k x head_dim x 2 B per block
    assert kvcache.decode_blocks_per_sm(DecodeConfig(128, 4, 3), 2) == 1  # 2 x 32 KiB
    assert kvcache.decode_blocks_per_sm(DecodeConfig(128, 4, 2), 3) == 2
    assert kvcache.decode_blocks_per_sm(DecodeConfig(128, 2, 4), 3) == 2  # 3 x 16 KiB
    assert kvcache.decode_blocks_per_sm(DecodeConfig(128, 8, 2), 1) == 1
    assert kvcache.decode_blocks_per_sm(DecodeConfig(64, 2, 2), 3) == 3  # 8 KiB a block: the resident cap
    assert kvcache.decode_blocks_per_sm(DecodeConfig(32, 2, 2), 8) == 8


@needs_nvrtc
def test_split_combine_kernel_compiles():
    """The fused merge of the split-KV partial results (the split plans' last launch; its numbers are
    checked on the GPU against no split and the reference)."""
    from tests.test_params import _compile_ok

    for arch in ("sm_80", "sm_90a"):  # real architectures: ptxas checks the cvt to bf16 / f16 too
        ok, log = _compile_ok(kvcache._COMBINE_SRC, arch)
        assert ok, log
    for name in ("float32", "float16", "bfloat16"):  # the combine's kernel per output dtype
        assert f"cuflash_split_combine_{name}," in kvcache._COMBINE_SRC


# ------------------------------------------------------------------ paged caches (block_table)

def test_only_the_decode_kernel_has_paged_instances():
    f = Features("bfloat16", 128, seqused_k=True, paged=True)
    assert f.tag() == "_kvlen_paged" and f.cxx().endswith("true, false, false, true, false, false, false, false, false>")
    assert [fam.name for fam in families.REGISTRY.values() if fam.supports(f)] == ["decode"]


def test_shell_takes_block_table_after_seqused_k():
    tile = families.DECODE.default(128)
    src = _compile.kernel_source(tile, Features("bfloat16", 128, seqused_k=True, paged=True))
    assert "const int* __restrict__ seqused_k, const int* __restrict__ block_table," in src
    assert "(q, k, v, out, lse, seqused_k, block_table, nullptr, nullptr, nullptr, nullptr, p);" in src
    # split instances take the in-kernel merge's targets and counters last (sm80/decode.cuh merge_splits)
    src = _compile.kernel_source(tile, Features("bfloat16", 128, seqused_k=True, paged=True, split_kv=True))
    assert "(q, k, v, out, lse, seqused_k, block_table, nullptr, merged_out, merged_lse, split_counters, p);" in src
    assert "cuflash::elem_t* __restrict__ merged_out, float* __restrict__ merged_lse, int* split_counters," in src


@pytest.mark.parametrize("table,why", [([[0, 4]], r"block_table\[0, 1\] = 4 is not a page"),
                                       ([[0, -1]], r"block_table\[0, 1\] = -1"),
                                       ([[0, 1], [2, 3]], r"shape \(batch=1"),
                                       ([0, 1], r"shape \(batch=1"),
                                       ([[0.0, 1.0]], "integers")])
def test_host_block_tables_are_checked(table, why):
    with pytest.raises(ValueError, match=why):
        kvcache.checked_block_table(table, 1, 4, 0)


def test_paged_cache_layouts_the_kernel_cannot_address_are_named():
    ok = (100, 16, 8, 128)
    assert kvcache.page_layout_problem(ok, (16 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 2), 2) is None
    flipped = kvcache.page_layout_problem(ok, (-16 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 2), 2)
    assert "non-negative strides" in flipped
    # rows of 1024 elements: a page of 2^21 rows ends just below 2^31 elements, one row more does not
    assert kvcache.page_layout_problem((2, 2**21, 8, 128), (2**32, 2048, 256, 2), 2) is None
    assert "2^31 elements" in kvcache.page_layout_problem((2, 2**21 + 1, 8, 128), (2**32 + 2048, 2048, 256, 2), 2)


def test_paged_decode_tile_rule():
    """Paged caches take the tiles measured to read pages better (families/sm80.py _decode_paged_tile:
    8 warps at d128 and d256, 4 warps at d64) where they fit and the grid is not already batch-rich;
    else the default."""
    import dataclasses
    import pathlib

    from cuflash.device import DeviceProps

    fix = pathlib.Path(__file__).parent / "fixtures" / "devices"
    h100, a100 = (DeviceProps.from_json(fix / f) for f in ("h100-sxm.json", "a100-80gb.json"))

    def pick(batch, d, page_size, props=h100):
        p = dataclasses.replace(_kv_problem(batch, 1, 32, 8, d, cap=4096), paged=True, page_size=page_size,
                                table_stride=4096 // page_size)
        return _decode_paged_tile(families.DECODE.default(d, props.smem_optin, p.features), p, props)

    default = {d: families.DECODE.defaults[d][0] for d in (64, 128, 256)}
    assert pick(8, 128, 16) == DecodeConfig(128, 8, 3)
    assert pick(8, 128, 256) == default[128]  # 0.99x contiguous as it is
    assert pick(8, 256, 16) == DecodeConfig(256, 8, 3) and pick(8, 256, 256) == DecodeConfig(256, 8, 2)
    assert default[64] == DecodeConfig(64, 8, 3)
    assert pick(8, 64, 16) == DecodeConfig(64, 4, 4)  # d64: 16-row pages narrow the 8-warp default
    assert pick(8, 64, 256) == default[64] and pick(64, 64, 16) == default[64]
    assert pick(64, 128, 16) == default[128]  # 512 (batch, K/V head)s fill two blocks per SM already
    assert pick(8, 128, 16, a100) == DecodeConfig(128, 8, 2)  # 8 warps, 3 stages: 196 KB > A100's 163 KB
    assert pick(8, 256, 16, a100) == DecodeConfig(256, 8, 2)
    assert all(t.smem_bytes <= h100.smem_optin and t.structural_problem() is None
               for ts in DECODE_PAGED_TILES.values() for t in ts)


def test_paged_calls_select_the_paged_tile_unless_tuned(monkeypatch):
    """families.select applies the paged rule to the default only: a tuned decode tile is kept."""
    import dataclasses
    import pathlib

    from cuflash import _tuned, device
    from cuflash.device import DeviceProps

    h100 = DeviceProps.from_json(pathlib.Path(__file__).parent / "fixtures" / "devices" / "h100-sxm.json")
    monkeypatch.setattr(device, "supported", lambda i=0: h100)
    monkeypatch.setattr(_tuned, "lookup", lambda fam, p, props: None)
    p = _kv_problem(8, 1, 32, 8, 128, cap=4096)
    paged = dataclasses.replace(p, paged=True, page_size=16, table_stride=256)
    assert families.select(families.DECODE, paged) == DecodeConfig(128, 8, 3)
    assert families.select(families.DECODE, p) == families.DECODE.defaults[128][0]
    tuned = DecodeConfig(128, 4, 4)
    monkeypatch.setattr(_tuned, "lookup", lambda fam, p, props: tuned)
    assert families.select(families.DECODE, paged) == tuned


def test_paged_params_carry_the_page_geometry():
    import dataclasses

    from cuflash import params

    p = dataclasses.replace(_kv_problem(2, 1, 8, 2, 128, cap=256), paged=True, page_size=16, table_stride=16)
    a = params.pack_fwd(p, 1)[0]
    assert (int(a["page_size"]), int(a["table_stride"])) == (16, 16)
    assert p.features.paged and kvcache.decode_problem(p) is None


def test_decode_tiles_split_columns_above_d128():
    from cuflash.tiles import DecodeConfig

    assert (DecodeConfig(128, 4, 3).col_splits, DecodeConfig(128, 4, 3).block_k) == (1, 64)
    assert (DecodeConfig(256, 8, 2).col_splits, DecodeConfig(256, 8, 2).block_k) == (2, 64)
    assert "even" in DecodeConfig(256, 3, 2).structural_problem()
    assert DecodeConfig(128, 3, 2).structural_problem() is None


def test_the_decode_kernel_takes_alibi_slopes_after_the_block_table():
    """ALiBi on the decode kernel: its instances take the slopes after seqused_k and the (possibly
    absent: nullptr) block table, and compile for sm_80 and sm_90 without spills at every head dim."""
    from tests.test_compile import _nvrtc_available

    for paged in (False, True):
        f = Features("bfloat16", 128, seqused_k=True, paged=paged, alibi=True)
        assert families.DECODE.supports(f)
        src = _compile.kernel_source(families.DECODE.default(128), f)
        table = "block_table" if paged else "nullptr"
        assert f"(q, k, v, out, lse, seqused_k, {table}, alibi_slopes, nullptr, nullptr, nullptr, p);" in src
    if not _nvrtc_available():
        return
    for d in sorted(families.DECODE.defaults):
        for split in (False, True):
            f = Features("float16", d, seqused_k=True, split_kv=split, alibi=True)
            for arch in ("sm_80", "sm_90"):
                rep = _compile.compile_report(_compile.kernel_source(families.DECODE.default(d, features=f), f), arch)
                assert rep["registers"] > 0 and rep["spill_stores"] == 0, (d, split, arch)


# ------------------------------------------------ dense calls of decode shape (cuflash.attention)

def _dense(nq, nk, h, hkv, d, causal=False, dropout=None, dtype="bfloat16"):
    from cuflash import problem
    from cuflash.mask import MaskOptions

    def info(shape):
        strides, acc = [], 2
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
        return problem.ArrayInfo(tuple(shape), dtype, 2, tuple(strides), 1 << 20, 0)

    return problem.resolve_forward(info((2, nq, h, d)), info((2, nk, hkv, d)), info((2, nk, hkv, d)),
                                   MaskOptions.of(causal=causal), None, dropout)


def test_dense_calls_of_decode_shape_take_the_decode_kernel(monkeypatch):
    """A dense forward whose query rows per K/V head fit the decode tile (a decoding step handing
    the whole cache to cuflash.attention, as Hugging Face's attention interface does) goes to the
    decode kernel, unless a backend is forced; the others keep the prefill kernels."""
    from cuflash import _forward, problem

    route = lambda p, backend=None: _forward._decode_route(families.FORWARDS, p, backend)  # noqa: E731
    monkeypatch.delenv("CUFLASH_BACKEND", raising=False)
    one = _dense(1, 8192, 32, 8, 128)  # Llama-3-8B, one new token
    assert kvcache.dense_decode_problem(one) is None and route(one)
    assert route(_dense(4, 500, 32, 8, 128, causal=True))  # 4 x 4 = 16 rows: a short chunk, causal
    assert route(_dense(16, 500, 4, 4, 64))  # MHA: 16 queries
    assert not route(_dense(5, 500, 32, 8, 128))  # 20 rows per K/V head
    assert not route(_dense(1, 500, 32, 8, 80))  # a partial head dim: no decode instance
    assert not route(_dense(1, 500, 32, 8, 128, dropout=problem.resolve_dropout(0.1, 3)))
    assert not route(one, "sm80") and not route(one, "sm90")
    monkeypatch.setenv("CUFLASH_BACKEND", "sm80")
    assert not route(one)
    monkeypatch.delenv("CUFLASH_BACKEND")
    assert not _forward._decode_route((families.FWD_V1,), one, None)  # algorithm="v1" stays v1


def test_a_dense_decode_plan_passes_null_lengths(monkeypatch):
    """plan_dense_decode: the decode kernel's (split) plan whose seqused_k is a null pointer (every
    batch at seqlen_k: MaskGeometry::for_batch); the call's inputs are the dense forward's (q, k,
    v, out, lse)."""
    import contextlib
    import pathlib

    cupy = pytest.importorskip("cupy")
    from cuflash import device
    from cuflash.device import DeviceProps

    h200 = DeviceProps.from_json(pathlib.Path(__file__).parent / "fixtures" / "devices" / "h200.json")
    calls = []

    class Rec:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, shared_mem=0):
            calls.append((self.name, grid, args))

    monkeypatch.setattr(device, "query", lambda device_id=0: h200)
    monkeypatch.setattr(_compile, "get_kernel", lambda cfg, f, dev: Rec(type(cfg).__name__))
    monkeypatch.setattr(kvcache, "_combine_kernel", lambda name: Rec("combine"))
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: ("alloc", tuple(shape)))
    monkeypatch.setattr(launch, "_capturing", lambda: False)  # no GPU: no capture
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: contextlib.nullcontext())
    from cuflash import _tuned, stream_scratch

    monkeypatch.setattr(_tuned, "lookup", lambda *a: None)  # the default tile (the shipped table tunes 8192's split floor)

    words = [0] * 16
    monkeypatch.setattr(stream_scratch, "reserve", lambda dev: None)
    monkeypatch.setattr(stream_scratch, "words", lambda dev, stream, name, n: words if n == 16 else None)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: types.SimpleNamespace(ptr=0))
    p = _dense(1, 8192, 32, 8, 128)
    plan = kvcache.plan_dense_decode(p, np.float16)
    out, lse = plan.run(("q", "k", "v", None, None))
    assert out == ("alloc", (2, 1, 32, 128)) and lse == ("alloc", (2, 32, 1))
    ((name, grid, args),) = calls  # one launch: the last split block of each tile merges (no combine)
    assert name == "DecodeConfig"
    assert args[:3] == ("q", "k", "v") and int(args[5]) == 0  # seqused_k null: every batch at seqlen_k
    n_splits = grid[0] // (8 * 2)
    assert n_splits == kvcache.decode_splits(16, 2, 132, 8192 // 64) > 1  # 16 work tiles: split over the GPU
    assert args[3] == ("alloc", (n_splits, 2, 1, 32, 128)) and args[6:8] == (out, lse)
    assert args[8] is words and len(words) == 16  # one counter per (K/V head, batch), the stream's scratch
    calls.clear()
    plan.run(("q2", "k2", "v2", "o", "l"))  # the caller's out / lse, the same lengths
    assert int(calls[0][2][5]) == 0 and calls[0][2][6:8] == ("o", "l")


def test_the_decode_kernel_reads_the_lengths_as_given(monkeypatch):
    """The decode kernel's plans take the cache's lengths before the append and add n_new and clip
    them themselves (FwdParams.seqused_add, sm80/decode.cuh): a call with device lengths launches
    no lengths kernel there. The prefill kernel's plans still get the attended lengths from it."""
    import dataclasses

    monkeypatch.setattr(_compile, "get_kernel", lambda cfg, f, dev: None)
    p = dataclasses.replace(_dense(1, 4096, 32, 8, 128), seqused_k=True)
    tile = families.DECODE.default(128)
    assert int(kvcache.plan_decode(p, tile, np.float16, seqused_add=3).params.packed[0]["seqused_add"]) == 3
    assert int(kvcache.plan_decode(p, tile, np.float16).params.packed[0]["seqused_add"]) == 0
    ran = []
    plan = types.SimpleNamespace(run=lambda arrays: ran.append(arrays) or ("out", "lse"))
    monkeypatch.setattr(kvcache, "_lengths_kernel", lambda: lambda lens, n_new, cap: ("clipped", lens, n_new, cap))
    monkeypatch.setattr(kvcache, "_append", lambda *a: None)
    monkeypatch.setattr(launch, "_capturing", lambda: False)  # no GPU: no capture
    decode = (p, tile)  # _Prepared.decode: the decode kernel's (problem, tile)
    for dec, want in ((decode, "lens"), (None, ("clipped", "lens", 2, 4096))):
        prep = kvcache._Prepared(p, plan, False, 2, dec)
        assert kvcache._execute(prep, "q", "k", "v", "lens", None, "kn", "vn", None, None, None) == ("out", "lse")
        assert ran.pop()[5] == want  # the plans' seqused_k slot
    # host lengths arrive staged with n_new added; the decode plan still takes the cache's own
    kvcache._execute(kvcache._Prepared(p, plan, False, 2, decode), "q", "k", "v", "lens", "used", "kn", "vn", None,
                     None, None)
    assert ran.pop()[5] == "lens"


def test_a_captured_int_length_runs_a_plan_without_lengths(monkeypatch):
    """Inside a CUDA graph capture a prepared decode call with one int length and no new rows runs
    its _uniform_plan: seqused_k a null pointer (the kernel reads it as the capacity) and
    seqused_add n - capacity, so the graph holds the kernel alone, no fill kernels of a lengths
    array; one plan per (problem, tile, dtype, length). Lengths past the capacity are refused."""
    import dataclasses

    monkeypatch.setattr(_compile, "get_kernel", lambda cfg, f, dev: None)
    p = dataclasses.replace(_dense(2, 4096, 32, 8, 128), seqused_k=True, n_splits=1)
    tile = families.DECODE.default(128)
    monkeypatch.setattr(kvcache, "_uniform_plans", kvcache.plan_cache.PlanCache())
    plan = kvcache._uniform_plan(kvcache._Prepared(p, None, False, 0, (p, tile)), 1000, np.float16)
    assert int(plan.params.packed[0]["seqused_add"]) == 1000 - 4096
    assert plan._n_inputs == 5 and len(kvcache._uniform_plans) == 1  # q, k, v, out, lse
    assert kvcache._uniform_plan(kvcache._Prepared(p, None, False, 0, (p, tile)), 1000, np.float16) is plan
    ran = []
    monkeypatch.setattr(kvcache, "_uniform_plan", lambda prep, n, dtype: types.SimpleNamespace(
        run=lambda arrays: ran.append((n, arrays)) or ("out", "lse")))
    monkeypatch.setattr(kvcache, "_lengths", lambda *a: pytest.fail("a captured int length staged lengths"))
    monkeypatch.setattr(kvcache, "_capturing", lambda: True)
    prep = kvcache._Prepared(p, "the prepared plan", False, 0, (p, tile))
    monkeypatch.setattr(kvcache._plans, "lookup", lambda key: prep)
    monkeypatch.setattr(kvcache, "_call_key", lambda *a: "key")
    q = types.SimpleNamespace(dtype=np.float16)
    assert kvcache._forward_cupy(q, "k", "v", 1000, None, None, MaskOptions(), None) == ("out", "lse")
    assert ran == [(1000, (q, "k", "v", None, None))]  # q, k, v, out, lse: no lengths slot
    with pytest.raises(ValueError, match="cache_seqlens"):
        kvcache._forward_cupy(q, "k", "v", 4097, None, None, MaskOptions(), None)


def _walk(row0, page_size, step, n):
    """kernels_cu/sm80/decode.cuh PagedTileRows::PageWalk, transcribed: (entry, in) of n rows step apart."""
    entry, inn = row0 // page_size, row0 - (row0 // page_size) * page_size
    out = []
    for _ in range(n):
        out.append((entry, inn))
        inn += step
        nxt = inn >= page_size
        inn -= page_size if nxt else 0
        entry += int(nxt)
        if inn >= page_size:
            entry += inn // page_size
            inn %= page_size
    return out


@pytest.mark.parametrize("step", [4, 8, 16, 128])
def test_the_paged_walk_finds_each_rows_page_and_place(step):
    """One division per tile, then (page, row in page) advanced step rows at a time: the same as a
    division per row for every page size, those smaller than the step included."""
    for page_size in (1, 2, 3, 7, 8, 15, 16, 17, 48, 64, 256, 1000):
        for row0 in (0, 1, 5, 63, 64, 255, 4097):
            rows = [row0 + i * step for i in range(8)]
            assert _walk(row0, page_size, step, 8) == [divmod(r, page_size) for r in rows], (page_size, row0)
