"""Block masks for mask snippets (cuflash/block_mask.py, kernels_cu/attn/block_mask.cuh) on the CPU:
the NumPy twin of the cells and lists against the definition (a query block visits a key block iff
some pair of the two is kept), the kernels' compiles (the two passes, the sm80 forward's block-mask
instances: registers and spills), and the argument checks that come before any launch. The GPU
tests (tests/gpu/test_block_mask_gpu.py) check the CUDA passes against the twin and the outputs."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import _compile, families
from cuflash.block_mask import _LISTS_SRC, FULL_BLOCK, BlockMask, _cells_source, build
from cuflash.features import Features
from cuflash.score_mods import ModSource, ScoreMod
from cuflash.testing import block_mask_reference
from tests.test_compile import _nvrtc_available

DOCS = ModSource(mask="doc[q_idx] == doc[kv_idx]", aux=(("doc", "int"),))


def _doc_keep(nq, nk, doc_len):
    q = np.arange(nq)[:, None] // doc_len
    k = np.arange(nk)[None, :] // doc_len
    return (q == k)[None, None]


@pytest.mark.parametrize("nq,nk,doc_len,bq,bk", [(300, 300, 64, 64, 64), (257, 513, 100, 128, 96), (40, 40, 7, 64, 48)])
def test_twin_lists_are_the_non_empty_blocks(nq, nk, doc_len, bq, bk):
    """A query block lists a key block iff some pair of the two is kept, flagged full iff every
    pair of it (inside the sequences) is."""
    keep = _doc_keep(nq, nk, doc_len)
    cells, full, counts, index = block_mask_reference(keep, bq, bk)
    assert cells.shape == full.shape == (1, -(-nq // 16), -(-nk // 16)) and not (full & ~cells).any()
    for i in range(-(-nq // bq)):
        blocks = [(j, keep[0, 0, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]) for j in range(-(-nk // bk))]
        want = [j | (FULL_BLOCK if blk.all() else 0) for j, blk in blocks if blk.any()]
        assert list(index[0, i, :counts[0, i]]) == want
    # a band of documents: each query block sees few key blocks, never all of them at this length
    if nq >= 256 and doc_len <= 100:
        assert counts.max() < -(-nk // bk)


def test_twin_of_a_full_and_an_empty_mask():
    every = np.ones((2, 3, 50, 70), dtype=bool)
    _, full, counts, index = block_mask_reference(every, 32, 32)
    assert full.all() and (counts == 3).all() and (index[..., :3] == [FULL_BLOCK, 1 | FULL_BLOCK, 2 | FULL_BLOCK]).all()
    _, _, counts, _ = block_mask_reference(np.zeros((1, 1, 50, 70), dtype=bool), 32, 32)
    assert (counts == 0).all()


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not available")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_two_passes_compile(arch):
    for src in (_cells_source(DOCS), _LISTS_SRC):
        rep = _compile.compile_report(src, arch)
        assert rep["spill_stores"] == 0, rep["log"]


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not available")
@pytest.mark.parametrize("family,dims", [("fwd_sm90", (64, 128)), ("bwd_sm90", (128,))])
def test_the_hopper_block_mask_instances_compile(family, dims):
    """The Hopper kernels' defaults with the document mask and its lists: one of them compiles
    without spills (ptxas, sm_90a; the snippet tile choice picks it)."""
    fam = families.REGISTRY[family]
    for d in dims:
        spills = [_compile.compile_report(_compile.kernel_source(
            t, Features("bfloat16", d, user_mod=True, mod=DOCS, block_mask=True)), "sm_90a")["spill_stores"]
                  for t in fam.defaults[d]]
        assert min(spills) == 0, (d, spills)


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not available")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("family", ["bwd", "bwd_dq"])
def test_the_sm80_backward_block_mask_instances_compile(arch, family):
    """The dK/dV and dQ kernels' default tiles with the document mask: the lists spill nothing
    more than the snippet alone (least-spilling tile of the defaults)."""
    fam = families.REGISTRY[family]
    for d in (64, 128):
        def least(bm):
            return min(_compile.compile_report(_compile.kernel_source(
                t, Features("bfloat16", d, user_mod=True, mod=DOCS, block_mask=bm)), arch)["spill_stores"]
                       for t in fam.defaults[d])
        assert least(True) <= least(False), d


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not available")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_sm80_forward_block_mask_instances_compile(arch):
    """The default tiles with a document and a band mask, with and without the block mask: the
    least-spilling tile (what _tile_for_snippet picks) spills no more with the lists than without
    (d64's 128 x 96 tile goes from 12 to 36 B with the band mask, its 128 x 64 one stays at 0)."""
    fam = families.REGISTRY["fwd"]
    band = ModSource(mask="kv_idx <= q_idx && q_idx - kv_idx < 256")
    for d in (64, 128):
        for mod in (DOCS, band):
            def least(bm):
                return min(_compile.compile_report(_compile.kernel_source(
                    t, Features("bfloat16", d, user_mod=True, mod=mod, block_mask=bm)), arch)["spill_stores"]
                           for t in fam.defaults[d])
            assert least(True) <= least(False), (d, mod)


def test_every_v2_family_takes_block_masks():
    f = Features("bfloat16", 128, user_mod=True, mod=DOCS, block_mask=True)
    takers = sorted(name for name, fam in families.REGISTRY.items() if fam.supports(f))
    assert takers == ["bwd", "bwd_dq", "bwd_sm90", "fwd", "fwd_sm90"]
    plain_mod = Features("bfloat16", 128, user_mod=True, mod=DOCS)
    assert families.FWD_V1.supports(plain_mod) is False  # v1 takes neither (the snippet already)


def test_building_needs_a_mask_snippet_and_sane_sizes():
    with pytest.raises(ValueError, match="a block mask needs a mask snippet"):
        build(ScoreMod("score * 2.f"), 1, 1, 64, 64)
    mod = ScoreMod(mask="kv_idx <= q_idx")
    with pytest.raises(ValueError, match="heads must be an int >= 1"):
        build(mod, 1, 0, 64, 64)
    with pytest.raises(ValueError, match="seqlen_k must be an int >= 0"):
        build(mod, 1, 1, 64, -1)
    # (batch x heads past 65,535 is fine: the passes stride over the pairs past the grid's y / z)
    with pytest.raises(ValueError, match="seqlen_k of a block mask must be at most 33553920"):
        build(mod, 300, 300, 64, 65535 * 32 * 16 + 1)


def test_a_block_mask_serves_only_its_own_calls():
    bm = BlockMask(DOCS, 1, 1, 1000, 1000, 0, bits=None)
    bm.check_call(DOCS, 4, 16, 1000, 1000, 0)  # broadcast over batch and heads
    with pytest.raises(ValueError, match="another ScoreMod"):
        bm.check_call(ModSource(mask="true"), 4, 16, 1000, 1000, 0)
    with pytest.raises(ValueError, match="seqlen_q=1000, seqlen_k=1000; the call has seqlen_q=999"):
        bm.check_call(DOCS, 4, 16, 999, 1000, 0)
    per_head = BlockMask(DOCS, 1, 8, 1000, 1000, 0, bits=None)
    with pytest.raises(ValueError, match="heads=8; the call has batch=4, heads=16"):
        per_head.check_call(DOCS, 4, 16, 1000, 1000, 0)
    with pytest.raises(ValueError, match="on device 0, the call's arrays on 1"):
        bm.check_call(DOCS, 4, 16, 1000, 1000, 1)
    with pytest.raises(ValueError, match="multiples of 16"):
        bm.lists(100, 64)


def test_problem_checks_name_block_mask():
    from cuflash import problem

    with pytest.raises(TypeError, match="block_mask must be a cuflash.BlockMask"):
        problem.with_block_mask(None, object(), ScoreMod(mask="true"))
    with pytest.raises(ValueError, match="block_mask needs the score_mod"):
        problem.with_block_mask(None, BlockMask(DOCS, 1, 1, 8, 8, 0, bits=None), None)
