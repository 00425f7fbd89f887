"""Head dims of real models (issue 12) on the GPU: every multiple of 8 from 8 to 256 through the
forward (sm80 v2 always; the sm90 forward where it is instantiated, 64, 128, 192 and 256, and the automatic
choice, which falls back to sm80 elsewhere), and a representative set through the backward (atomic
and deterministic dQ, GQA), against the float64 reference by FlashAttention's 2x rule, both dtypes,
causal and not, ragged seqlens, outputs poisoned with NaN.

Head dims between the instantiated ones (32, 64, 96, 128, 192, 256) run the next one's partial_d
instance in place: the tests feed q, k, v as views of wider arrays whose extra columns hold huge
values, so a kernel that read a column past the call's head dim would fail the reference check, and
the gradients are fresh arrays whose rows abut (a store past the head dim would clobber the next row).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash.testing import dtype_of, fa_rule, fa_rule_grads, naive, random_qkv
from tests.gpu.test_forward_gpu import backend  # noqa: F401  (the sm80 / sm90 fixture)
from tests.gpu.test_gqa_gpu import _poison_pool

pytestmark = pytest.mark.gpu

ALL_DIMS = list(range(8, 257, 8))
BWD_DIMS = [8, 24, 32, 40, 64, 80, 96, 112, 128, 136, 160, 192, 200, 256]
SEQLENS = [(17, 17), (113, 203), (239, 1), (1, 239), (300, 257)]
GUARD = 8  # extra columns of the wider arrays q, k, v are views of (filled with GUARD_VALUE)
GUARD_VALUE = 3.0e4


def _inputs(seed, b, nq, nk, h, d, dtype, hkv=None, guard=True):
    """q, k, v (+ dout) of head dim d; with `guard`, views [..., :d] of (.., d + GUARD) arrays whose
    extra columns hold GUARD_VALUE (heads stride d + GUARD: still 16-byte aligned)."""
    import cupy

    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of(dtype), heads_kv=hkv)
    dout, _, _ = random_qkv(rng, b, nq, 1, h, d, dtype_of(dtype))
    if not guard:
        return q, k, v, dout

    # built through uint16 views: CuPy copies 16-bit words whatever the element type (bf16 included)
    guard_bits = int(np.array([GUARD_VALUE], dtype=np.float32).astype(q.dtype).view(np.uint16)[0])

    def wide(x):
        w = cupy.full((*x.shape[:-1], d + GUARD), guard_bits, dtype=cupy.uint16)
        w[..., :d] = x.view(cupy.uint16)
        return w.view(x.dtype)[..., :d]

    return wide(q), wide(k), wide(v), wide(dout)


def _contig(x):
    """A C-contiguous copy (for the references), through a uint16 view."""
    import cupy

    return cupy.ascontiguousarray(x.view(cupy.uint16)).view(x.dtype)


def _poisoned_fwd(q, k, v, causal, **kw):
    import cupy
    from cuflash import _forward

    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
    return _forward.forward(q, k, v, causal=causal, out=out, lse=lse, **kw)


def _check_forward(out, lse, q, k, v, causal):
    import cupy

    assert out.shape == q.shape and out.dtype == q.dtype
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any()), "unwritten or NaN output"
    assert not bool(cupy.isnan(lse).any()), "unwritten lse"
    scale = 1 / math.sqrt(q.shape[-1])  # the default: 1/sqrt of the call's head dim
    qc, kc, vc = (_contig(x) for x in (q, k, v))
    err, pt_err, allowed = fa_rule(out, qc, kc, vc, causal, scale)
    assert err <= allowed, f"max err {err:.3e} > allowed {allowed:.3e} (same-dtype err {pt_err:.3e})"
    _, lse_ref = naive(qc, kc, vc, causal, scale, cupy.float64)
    finite = cupy.isfinite(lse_ref)
    assert bool((cupy.isfinite(lse) == finite).all()), "lse -inf pattern differs from reference"
    if bool(finite.any()):
        assert float(cupy.abs(lse.astype(cupy.float64) - lse_ref)[finite].max()) < 1e-3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", ALL_DIMS)
def test_forward_every_head_dim_sm80(d, causal, dtype):
    import cupy

    import cuflash

    for nq, nk in SEQLENS:
        q, k, v, _ = _inputs(hash((d, causal, dtype, nq, nk, "hd-fwd")) % 2**32, 2, nq, nk, 3, d, dtype)
        out, lse = _poisoned_fwd(q, k, v, causal, backend="sm80")
        _check_forward(out, lse, q, k, v, causal)
        # the public entry point with the automatic backend (sm90 on an H200 at 64/128, else sm80)
        auto = cuflash.attention(q, k, v, causal=causal)
        assert auto.shape == q.shape and not bool(cupy.isnan(auto.astype(cupy.float32)).any())
        err, _, allowed = fa_rule(auto, *(_contig(x) for x in (q, k, v)), causal, 1 / math.sqrt(d))
        assert err <= allowed


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_forward_instantiated_head_dims_each_backend(d, causal, dtype, backend):  # noqa: F811
    for nq, nk in SEQLENS:
        q, k, v, _ = _inputs(hash((d, causal, dtype, nq, nk, "hd-fwd-be")) % 2**32, 2, nq, nk, 3, d, dtype, guard=False)
        out, lse = _poisoned_fwd(q, k, v, causal, backend=backend)
        _check_forward(out, lse, q, k, v, causal)


def test_sm90_refuses_other_head_dims_with_a_reason():
    from cuflash import _forward
    from cuflash.testing import backend_unavailable

    why = backend_unavailable("sm90")
    if why:
        pytest.skip(why)
    for d in (32, 24, 96, 80):  # the instances 32 and 96 have no Hopper form (48, 200: its column masking)
        q, k, v, _ = _inputs(d, 1, 64, 64, 2, d, "bfloat16", guard=False)
        with pytest.raises(ValueError, match="cannot run this call"):
            _forward.forward(q, k, v, backend="sm90")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [40, 96, 200])
def test_forward_v1_head_dims(d, causal, dtype):
    from cuflash._forward_v1 import forward_v1

    if d > 128:
        q, k, v, _ = _inputs(1, 1, 64, 64, 2, d, dtype)
        # v1 has nothing past d128 (its tiles spill)
        with pytest.raises(RuntimeError, match=rf"head_dim {d} \(on the kernels of head dim 256\)"):
            forward_v1(q, k, v, causal=causal)
        return
    for nq, nk in SEQLENS:
        q, k, v, _ = _inputs(hash((d, causal, dtype, nq, nk, "hd-v1")) % 2**32, 2, nq, nk, 3, d, dtype)
        import cupy

        out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
        lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
        out, lse = forward_v1(q, k, v, causal=causal, out=out, lse=lse)
        _check_forward(out, lse, q, k, v, causal)


def _check_grads(grads, q, k, v, dout, causal):
    import cupy

    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert not bool(cupy.isnan(g.astype(cupy.float32)).any()), "NaN (unwritten?) in a gradient"
    qc, kc, vc, dc = (_contig(x) for x in (q, k, v, dout))
    res = fa_rule_grads(grads, qc, kc, vc, dc, causal, 1 / math.sqrt(q.shape[-1]))
    for name, (err, pt_err, allowed) in res.items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt_err:.3e})"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", BWD_DIMS)
def test_backward_head_dims(d, causal, dtype, deterministic):
    from cuflash import _backward, _forward

    for nq, nk in SEQLENS:
        q, k, v, dout = _inputs(hash((d, causal, dtype, deterministic, nq, nk, "hd-bwd")) % 2**32, 2, nq, nk, 3, d,
                                dtype)
        out, lse = _forward.forward(q, k, v, causal=causal, backend="sm80")
        _poison_pool(q.shape, k.shape)
        grads = _backward.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
        _check_grads(grads, q, k, v, dout, causal)


@pytest.mark.parametrize("d", [40, 96, 256])
def test_backward_head_dims_gqa(d):
    """GQA with a head dim past the instantiated ones: the expanded per-query-head buffers and their
    group sum (rowwise/bwd_dkdv_reduce.cuh) take the call's head dim."""
    from cuflash import _backward, _forward

    q, k, v, dout = _inputs(d, 2, 150, 333, 8, d, "bfloat16", hkv=2)
    out, lse = _forward.forward(q, k, v, causal=True)
    for deterministic in (False, True):
        _poison_pool(q.shape, k.shape, (2, 333, 8, d))
        grads = _backward.backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
        assert grads[1].shape == k.shape
        _check_grads(grads, q, k, v, dout, True)  # fa_rule_grads sums the references over each group


def test_public_api_and_explicit_scale_with_an_odd_head_dim():
    """cuflash.attention / attention_backward at d=80 (Phi-2's head dim): an explicit scale is used as
    given, the default is 1/sqrt(80)."""
    import cuflash

    q, k, v, dout = _inputs(80, 2, 200, 200, 4, 80, "float16")
    qc, kc, vc, dc = (_contig(x) for x in (q, k, v, dout))
    for scale in (None, 0.05):
        out, lse = cuflash.attention(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
        ref_scale = 1 / math.sqrt(80) if scale is None else scale
        err, _, allowed = fa_rule(out, qc, kc, vc, True, ref_scale)
        assert err <= allowed
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale)
        res = fa_rule_grads(grads, qc, kc, vc, dc, True, ref_scale)
        for name, (err, pt_err, allowed) in res.items():
            assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e}"


@pytest.fixture
def as_99kb_gpu(monkeypatch):
    """This GPU as a ~99 KB one (cc 8.6 / 8.9: 101,376 B of shared memory per block), compiling for
    itself: selection sees the smaller limit, the shipped tables (tuned for this GPU's full limit)
    are out of the way, and the plan caches are empty before and after."""
    import dataclasses

    from cuflash import _backward, _forward, _tuned, device

    real = device.query(0)
    small = dataclasses.replace(real, smem_optin=101376)
    monkeypatch.setattr(device, "query", lambda device_id=0: small)
    monkeypatch.setattr(_tuned, "lookup", lambda *a, **k: None)
    for cache in (_forward._plans, _backward._plans):
        cache.clear()
    yield small
    for cache in (_forward._plans, _backward._plans):
        cache.clear()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [160, 192, 224, 256])
def test_backward_large_head_dims_as_on_a_99kb_gpu(as_99kb_gpu, d, dtype):
    """The d192 / d256 backward with only ~99 KB per block: the 2-warp 32 x 32 tiles with one dS^T
    buffer (and a barrier per query tile), their partial-head-dim instances (160, 224), causal or
    not, atomic and deterministic dQ, GQA, by the 2x rule with outputs poisoned."""
    from cuflash import _backward, _forward, families, tiles

    kd = tiles.kernel_head_dim(d)
    assert families.BWD.default(kd, as_99kb_gpu.smem_optin) == tiles.BwdConfig(kd, 32, 32, 2, 2)
    for causal in (False, True):
        for deterministic in (False, True):
            for (nq, nk), hkv in (((113, 203), None), ((300, 257), 1), ((1, 239), None), ((239, 1), None)):
                q, k, v, dout = _inputs(hash((d, dtype, causal, deterministic, nq, nk, "99kb")) % 2**32, 2, nq, nk,
                                        4, d, dtype, hkv=hkv)
                out, lse = _forward.forward(q, k, v, causal=causal)
                _poison_pool(q.shape, k.shape)
                grads = _backward.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
                _check_grads(grads, q, k, v, dout, causal)
