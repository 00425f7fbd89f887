"""Variable-length batches on the CPU (issue 12): what cuflash.varlen.resolve accepts and refuses, the
problem and parameter struct it builds, and the varlen kernel instances' compiles (no spills, the
defaults of every head dim and feature mix). The GPU results: tests/gpu/test_varlen_gpu.py."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cuflash import _compile, families, params
from cuflash.features import Features
from cuflash.mask import UNBOUNDED, MaskOptions
from cuflash.problem import ArrayInfo
from cuflash.varlen import resolve
from tests.test_compile import _nvrtc_available


def _info(shape, dtype="bfloat16", device=0):
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8}[dtype]
    strides = tuple(int(s) * itemsize for s in np.cumprod((1, *shape[::-1]))[:-1][::-1]) if shape else ()
    return ArrayInfo(tuple(shape), dtype, itemsize, strides, 1 << 20, device)


def _args(total_q=100, total_k=120, h=8, hk=2, d=128, batch=3, **over):
    a = dict(qi=_info((total_q, h, d)), ki=_info((total_k, hk, d)), vi=_info((total_k, hk, d)),
             cu_q=_info((batch + 1,), "int32"), cu_k=_info((batch + 1,), "int32"),
             max_seqlen_q=64, max_seqlen_k=80, mask=MaskOptions.of(causal=True), softmax_scale=None)
    a.update(over)
    return a


def test_resolve_builds_the_varlen_problem():
    p = resolve(**_args())
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k) == (3, 64, 80, 100, 120)
    assert (p.heads, p.heads_kv, p.head_dim, p.group) == (8, 2, 128, 4)
    assert p.varlen and p.align_end and p.offset == 0 and (p.window_left, p.window_right) == (UNBOUNDED, 0)
    assert p.strides["q"] == (0, 8 * 128, 128) and p.strides["k"] == (0, 2 * 128, 128)
    assert p.features == Features("bfloat16", 128, varlen=True)
    top_left = resolve(**_args(mask=MaskOptions.of(causal=True, alignment="top_left")))
    assert not top_left.align_end and top_left.offset == 0
    window = resolve(**_args(mask=MaskOptions.of(window_size=(16, 4))))
    assert (window.window_left, window.window_right, window.offset) == (16, 4, 0) and window.features.local


def test_packed_params_carry_totals_and_the_alignment():
    p = resolve(**_args())
    a = params.pack_fwd(p, m_blocks=1)
    assert (int(a["seqlen_q"][0]), int(a["seqlen_k"][0]), int(a["align_end"][0])) == (100, 120, 1)
    assert (int(a["o_sb"][0]), int(a["o_sn"][0]), int(a["o_sh"][0])) == (0, 8 * 128, 128)
    assert (int(a["q_sb"][0]), int(a["offset"][0]), int(a["tiles"][0])) == (0, 0, 1 * 8 * 3)
    dense = params.pack_fwd(resolve(**_args(mask=MaskOptions.of(alignment="top_left"))), m_blocks=2)
    assert int(dense["align_end"][0]) == 0


@pytest.mark.parametrize("over,exc,words", [
    (dict(qi=_info((2, 100, 8, 128))), ValueError, "q must have 3 dimensions"),
    (dict(ki=_info((120, 3, 128)), vi=_info((120, 3, 128))), ValueError, "multiple of k and v's"),
    (dict(qi=_info((100, 8, 100))), ValueError, "head_dim must be a multiple of 8"),
    (dict(qi=_info((100, 8, 128), "float32")), TypeError, "dtype"),
    (dict(cu_q=_info((3, 1), "int32")), ValueError, "cu_seqlens_q must have shape"),
    (dict(cu_k=_info((0,), "int32")), ValueError, "cu_seqlens_k must have shape"),
    (dict(cu_q=_info((4,), "float32")), TypeError, "cu_seqlens_q must hold integers"),
    (dict(cu_k=_info((4,), "int32", device=1)), ValueError, "cu_seqlens_k is on device 1"),
    (dict(cu_k=_info((5,), "int32")), ValueError, "the same length"),
    (dict(max_seqlen_q=0), ValueError, "max_seqlen_q is 0 but there are 100 tokens"),
    (dict(max_seqlen_k=-1), ValueError, r"max_seqlen_k must be in \[0, 2\^28\)"),
    (dict(max_seqlen_q=64.0), TypeError, "max_seqlen_q must be an int"),
    (dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int"),
])
def test_resolve_refuses_with_the_argument_named(over, exc, words):
    with pytest.raises(exc, match=words):
        resolve(**_args(**over))


def test_empty_batches_and_sequences_resolve():
    assert resolve(**_args(total_q=0, max_seqlen_q=0)).empty
    assert resolve(**_args(total_k=0, max_seqlen_k=0)).empty
    assert resolve(**_args(batch=0)).empty
    assert not resolve(**_args()).empty  # a single empty sequence is the kernel's (its blocks return at once)


def test_only_the_sm80_forward_takes_varlen():
    f = Features("bfloat16", 128, varlen=True)
    assert families.FWD.supports(f)
    assert not any(fam.supports(f) for fam in families.REGISTRY.values() if fam is not families.FWD)


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
def test_varlen_defaults_compile_without_spills(d, arch):
    """Every feature mix varlen may take (window, softcap, a partial head dim) on the default tile
    the family picks for it, on both targets (an H100/H200 runs varlen on this family)."""
    for local, softcap, partial in itertools.product((False, True), repeat=3):
        f = Features("bfloat16", d, local=local, softcap=softcap, partial_d=partial, varlen=True)
        tile = families.FWD.default(d, features=f)
        rep = _compile.compile_report(_compile.kernel_source(tile, f), arch)
        assert rep["registers"] > 0, rep["log"]
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (tile, f, rep["registers"], rep["spill_stores"])
