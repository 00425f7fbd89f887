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


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("name", ["bwd_prep_varlen", "bwd_dq_convert_varlen"])
def test_varlen_rowwise_kernels_compile(name):
    for d in (32, 64, 128, 256):
        src, _ = _compile.aux_source(name, "bfloat16", d)
        rep = _compile.compile_report(src, "sm_80")
        assert rep["registers"] > 0 and rep["spill_stores"] == 0, rep["log"]


def test_empty_batches_and_sequences_resolve():
    assert resolve(**_args(total_q=0, max_seqlen_q=0)).empty
    assert resolve(**_args(total_k=0, max_seqlen_k=0)).empty
    assert resolve(**_args(batch=0)).empty
    assert not resolve(**_args()).empty  # a single empty sequence is the kernel's (its blocks return at once)


def test_the_sm80_families_and_the_hopper_forward_and_backward_take_varlen():
    f = Features("bfloat16", 128, varlen=True)
    takes = {families.FWD, families.BWD, families.BWD_DQ, families.FWD_SM90, families.BWD_SM90}
    assert all(fam.supports(f) for fam in takes)
    assert not any(fam.supports(f) for fam in families.REGISTRY.values() if fam not in takes)


def test_varlen_backward_takes_the_hopper_kernel_on_the_h200(monkeypatch):
    from cuflash import _backward, device, tma
    from cuflash.varlen import resolve_backward
    from tests.test_sm90_host import H200

    monkeypatch.setattr(device, "query", lambda *_a, **_k: H200)
    monkeypatch.setattr(tma, "bindings_problem", lambda: None)
    monkeypatch.delenv(families.BACKEND_ENV, raising=False)
    a = _args()
    out, lse = _info((100, 8, 128)), _info((8, 100), "float32")
    p = resolve_backward(out, a["qi"], a["ki"], a["vi"], out, lse, a["cu_q"], a["cu_k"], 64, 80, a["mask"], None)
    assert _backward._main_family(p, None, None) is families.BWD_SM90
    assert _backward._main_family(p, None, "sm80") is families.BWD


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("family", ["fwd", "bwd", "bwd_dq"])
def test_varlen_defaults_compile_without_spills(family, d, arch):
    """Every feature mix varlen may take (window, softcap, a partial head dim; dropout with windows
    and softcap) on the default tile each family picks for it, on both targets (an H100/H200 runs
    varlen on these families)."""
    fam = families.REGISTRY[family]
    mixes = [(*m, False) for m in itertools.product((False, True), repeat=3)]
    mixes += [(local, softcap, False, True) for local, softcap in itertools.product((False, True), repeat=2)]
    for local, softcap, partial, dropout in mixes:
        f = Features("bfloat16", d, local=local, softcap=softcap, partial_d=partial, dropout=dropout, varlen=True)
        tile = fam.default(d, features=f)
        rep = _compile.compile_report(_compile.kernel_source(tile, f), arch)
        assert rep["registers"] > 0, rep["log"]
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (tile, f, rep["registers"], rep["spill_stores"])


def test_packed_backward_params_and_workspace_rows():
    from cuflash import _backward
    from cuflash.varlen import resolve_backward

    a = _args()
    out, lse = _info((100, 8, 128)), _info((8, 100), "float32")
    p = resolve_backward(out, a["qi"], a["ki"], a["vi"], out, lse, a["cu_q"], a["cu_k"], 64, 80, a["mask"], None)
    pad = _backward.varlen_ws_rows_per_head(p)
    assert pad == 512 and pad % 128 == 0 and pad >= p.total_q + 128 * p.batch  # 100 + 3 x 128 = 484 -> 512
    b = params.pack_bwd(p, pad, n_blocks=1)
    assert (int(b["seqlen_q"][0]), int(b["seqlen_k"][0]), int(b["seqlen_q_pad"][0]), int(b["align_end"][0])) == \
        (100, 120, 512, 1)
    assert int(b["ws_rows"][0]) == 8 * 512 and int(b["kv_rows"][0]) == 120 * 2  # GQA: dK/dV reduced over 4
    assert (int(b["dq_sb"][0]), int(b["dq_sn"][0]), int(b["dk_sn"][0])) == (0, 8 * 128, 8 * 128)
    assert (int(b["o_sb"][0]), int(b["do_sn"][0])) == (0, 8 * 128)


def test_workspace_rows_of_sequences_never_overlap():
    """SeqSpan::ws_row0's varlen rows (the kernels' formula, here in NumPy): each sequence starts
    128-aligned and has at least its length rounded up to 128 rows before the next one starts."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        lens = rng.integers(0, 400, rng.integers(1, 12))
        cu = np.concatenate([[0], np.cumsum(lens)])
        start = (cu[:-1] + 128 * np.arange(len(lens))) & ~127
        end = start + -(-lens // 128) * 128
        assert (start % 128 == 0).all() and (end[:-1] <= start[1:]).all()
        assert end[-1] <= -(-(cu[-1] + 128 * len(lens)) // 128) * 128


@pytest.mark.parametrize("over,exc,words", [
    (dict(oi=_info((100, 8, 64))), ValueError, "out must have q's shape"),
    (dict(doi=_info((100, 8, 128), "float16")), TypeError, "dout must have q's dtype"),
    (dict(li=_info((100, 8), "float32")), ValueError, r"lse must have shape \(heads, total_q\)"),
    (dict(li=_info((8, 100), "bfloat16")), TypeError, "lse must be float32"),
])
def test_resolve_backward_refuses_with_the_argument_named(over, exc, words):
    from cuflash.varlen import resolve_backward

    a = _args()
    kw = dict(doi=_info((100, 8, 128)), qi=a["qi"], ki=a["ki"], vi=a["vi"], oi=_info((100, 8, 128)),
              li=_info((8, 100), "float32"), cu_q=a["cu_q"], cu_k=a["cu_k"], max_seqlen_q=64, max_seqlen_k=80,
              mask=a["mask"], softmax_scale=None)
    kw.update(over)
    with pytest.raises(exc, match=words):
        resolve_backward(**kw)


def test_hopper_maps_of_packed_arrays_are_one_batch_of_all_rows():
    from cuflash import tma

    p = resolve(**_args())
    shape, strides = tma.tensor_layout(p, "q")
    assert shape == (1, 100, 8, 128) and strides[1:] == (8 * 128 * 2, 128 * 2, 2)
    shape, _ = tma.tensor_layout(p, "k")
    assert shape == (1, 120, 2, 128)
    assert tma.tensors_problem(p) is None


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_hopper_varlen_defaults_compile_without_spills(d):
    fam = families.FWD_SM90
    for local, softcap in itertools.product((False, True), repeat=2):
        f = Features("bfloat16", d, local=local, softcap=softcap, varlen=True)
        tile = fam.default(d, features=f)
        rep = _compile.compile_report(_compile.kernel_source(tile, f), "sm_90a")
        assert rep["registers"] > 0 and rep["spill_stores"] == 0, (tile, f, rep["spill_stores"])
        assert "serialized" not in rep["log"].lower(), rep["log"][-2000:]


def test_sinks_rescale_the_packed_layout_per_sequence():
    """attention_varlen(sinks=): the kernels' packed (out (total_q, heads, d), lse (heads, total_q))
    rescaled by cuflash/sinks.py as one batch (varlen._with_sinks) is each sequence's attention with
    sinks (float64, NumPy stand-ins for the kernels' results)."""
    from cuflash import reference, varlen

    rng = np.random.default_rng(2)
    lens_q, lens_k, h, d = [5, 0, 9], [7, 3, 4], 3, 8
    sinks = rng.standard_normal(h)
    oq, ok = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    q, k, v = (rng.standard_normal((n, h, d)) for n in (oq[-1], ok[-1], ok[-1]))
    out, lse = np.zeros_like(q), np.zeros((h, oq[-1]))
    for b in range(3):
        rq, rk = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        o, l = reference.attention_naive(q[None, rq], k[None, rk], v[None, rk], causal=True)
        out[rq], lse[:, rq] = o[0], l[0]
    got, got_lse = varlen._with_sinks(out, lse, sinks)
    for b in range(3):
        rq, rk = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        want, want_lse = reference.attention_sinks(q[None, rq], k[None, rk], v[None, rk], sinks, causal=True)
        np.testing.assert_allclose(got[rq], want[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_lse[:, rq], want_lse[0], rtol=1e-12)
    assert varlen._with_sinks(out, lse, None) == (out, lse)
