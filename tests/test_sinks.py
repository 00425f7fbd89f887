"""Attention sinks without a GPU (issue 13): the exact rescale of (out, lse) and the backward
through (out', lse') against the definition (a sink column in every row's softmax), its gradient
by finite differences, and the argument checks. GPU tests: tests/gpu/test_sinks_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import reference, sinks

MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (3, -1)), (False, (2, 1))]


def _case(seed, b=2, nq=5, nk=7, h=4, hk=2, d=8):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((b, nq, h, d)), rng.standard_normal((b, nk, hk, d)), rng.standard_normal((b, nk, hk, d))
    return q, k, v, rng.standard_normal(h) * 2


@pytest.mark.parametrize("causal,window", MASKS)
def test_rescale_equals_the_definition(causal, window):
    q, k, v, s = _case(1)
    out, lse = reference.attention_naive(q, k, v, causal=causal, window_size=window)
    got_out, got_lse = sinks.apply(out, lse, s)
    want_out, want_lse = reference.attention_sinks(q, k, v, s, causal=causal, window_size=window)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12, atol=1e-12)


def test_rows_without_keys_give_zero_and_the_sink():
    q, k, v, s = _case(2, nq=4, nk=2)
    # causal with more queries than keys, top-left: the first rows see keys; bottom-right: the
    # first nq - nk rows see none
    out, lse = reference.attention_naive(q, k, v, causal=True)
    assert np.isneginf(lse[:, :, 0]).all()
    o2, l2 = sinks.apply(out, lse, s)
    assert (o2[:, 0] == 0).all() and np.allclose(l2[:, :, 0], s[None, :])


@pytest.mark.parametrize("causal,window", MASKS)
def test_backward_through_the_rescaled_outputs_is_the_gradient(causal, window):
    """dq, dk, dv from the ordinary backward fed (out', lse') equal finite differences of
    L = sum(dout o out_sinks(q, k, v)); d sinks from sinks.grad equals its finite difference."""
    q, k, v, s = _case(3, b=1, nq=3, nk=4, h=2, hk=1, d=4)
    dout = np.random.default_rng(4).standard_normal(q.shape)
    out, lse = reference.attention_sinks(q, k, v, s, causal=causal, window_size=window)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, out, lse, causal=causal, window_size=window)
    ds = sinks.grad(dout, out, lse, s)

    def loss(q_=q, k_=k, v_=v, s_=s):
        o, _ = reference.attention_sinks(q_, k_, v_, s_, causal=causal, window_size=window)
        return float((dout * o).sum())

    eps = 1e-6
    for x, g, name in ((q, dq, "q"), (k, dk, "k"), (v, dv, "v"), (s, ds, "sinks")):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            kw = {"q": dict(q_=xp), "k": dict(k_=xp), "v": dict(v_=xp), "sinks": dict(s_=xp)}[name]
            kwm = {"q": dict(q_=xm), "k": dict(k_=xm), "v": dict(v_=xm), "sinks": dict(s_=xm)}[name]
            num[idx] = (loss(**kw) - loss(**kwm)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-7, err_msg=name)


def test_checks_name_the_argument():
    q = np.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"shape \(heads=4,\)"):
        sinks.check(np.zeros(3), 4, q)
    with pytest.raises(TypeError, match="floating"):
        sinks.check(np.zeros(4, dtype=np.int32), 4, q)
    with pytest.raises(TypeError, match="numpy array like q"):
        sinks.check([0.0] * 4, 4, q)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_fused_kernels_compile_without_spills(arch):
    """cuflash.sinks' fused rescale and gradient (CuPy RawModule at run time) compile with NVRTC for
    the oldest and the newest target, ptxas reporting no spills."""
    pytest.importorskip("cupy")
    from cuflash import _compile, sinks

    rep = _compile.compile_report(sinks._FUSED_SRC, arch)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep["log"]
    for name in ("apply", "grad"):
        for dt in ("bfloat16", "float16"):
            assert f"cuflash_sinks_{name}_{dt}" in rep["log"]


# (family, head_dim, variants beside sinks): the tile each selects compiles spill-free with the
# sinks' epilogue, for the family's targets (the sm80 forward's sm_90a softcap default spills without
# sinks too: tests/test_shipped_tiles_compile.py's KNOWN_SPILLS)
_SINK_CASES = [(fam, d, kw) for fam in ("fwd", "fwd_sm90") for d in (64, 128)
               for kw in ({}, {"dropout": True}, {"softcap": True}, {"alibi": True}, {"local": True}, {"varlen": True},
                          {"local": True, "softcap": True})]


@pytest.mark.parametrize("fam_name,d,kw", _SINK_CASES, ids=lambda x: str(x) if not isinstance(x, dict) else
                         "+".join(x) or "plain")
def test_sink_instances_compile_without_spills(fam_name, d, kw):
    pytest.importorskip("cupy")
    from cuflash import _compile, families
    from cuflash.features import Features

    fam = families.REGISTRY[fam_name]
    f = Features("bfloat16", d, sinks=True, **kw)
    assert fam.supports(f)
    tile = fam.default(d, features=f)
    for arch in ("sm_90a",) if fam.arch_specific else ("sm_80", "sm_90a"):
        if fam_name == "fwd" and arch == "sm_90a" and d == 64 and kw == {"softcap": True}:
            continue  # 40 B without sinks as well (known), run on Hopper only for the calls the Hopper kernel lacks
        if fam_name == "fwd_sm90" and d == 64 and kw == {"alibi": True}:
            continue  # 12 B without sinks as well (tests/test_alibi.py)
        rep = _compile.compile_report(_compile.kernel_source(tile, f), fam.nvrtc_arch(_Props(arch)))
        assert rep["spill_stores"] == 0, (tile, arch, rep["spill_stores"])


class _Props:  # what KernelFamily.nvrtc_arch reads of device properties
    def __init__(self, arch):
        self.arch = self.arch_specific = arch


def test_only_the_v2_forwards_join_sinks_in_the_kernel():
    from cuflash import families
    from cuflash.features import Features

    f = Features("bfloat16", 128, sinks=True)
    assert sorted(fam.name for fam in families.REGISTRY.values() if fam.supports(f)) == ["fwd", "fwd_sm90"]
    assert not families.FWD.supports(Features("bfloat16", 128, sinks=True, split_kv=True))
    src = _compile_src(families.FWD_SM90, f)
    assert src.rstrip().endswith("nullptr, nullptr, nullptr, sinks, p);\n}"), src[-200:]


def _compile_src(fam, f):
    from cuflash import _compile

    return _compile.kernel_source(fam.default(f.head_dim, features=f), f)
