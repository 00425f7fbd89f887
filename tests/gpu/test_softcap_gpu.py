"""Softcap (issue 13) on the GPU: forward on every forward family (v2 on both backends, v1) and
backward on the sm80 kernels (atomic and deterministic dQ) and the opt-in sm90 backward, with
causal masks, windows and dropout, both dtypes, head_dim 64 and 128, ragged seqlens, against the
float64 reference with FlashAttention's 2x rule (cuflash.testing's oracles take the record with
its softcap). Outputs poisoned before each launch. Inputs are scaled up (logits of magnitude ~10)
so that the tanh is far from linear at the caps used."""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from cuflash.mask import MaskOptions
from cuflash.philox import dropout_keep_mask, dropout_scale
from cuflash.testing import backend_unavailable, dtype_of, fa_rule, fa_rule_grads, naive, random_qkv
from tests.gpu.test_forward_gpu import backend  # noqa: F401  (the fixture: every forward backend of the GPU)

pytestmark = pytest.mark.gpu

INPUT_SCALE = 2.0  # q, k ~ N(0, 4): scores softmax_scale q.k ~ N(0, 16)

# (seqlen_q, seqlen_k, causal, window_size, softcap): caps well inside the scores' range (strong
# capping) and above it (near linear), ragged seqlens both ways, a window, rows that see no key
CASES = [
    (256, 256, False, (-1, -1), 5.0), (256, 256, True, (-1, -1), 2.0), (113, 203, True, (-1, -1), 30.0),
    (203, 113, True, (-1, -1), 5.0), (1, 239, False, (-1, -1), 1.0), (1000, 1000, True, (64, 0), 5.0),
    (300, 517, False, (100, 7), 10.0), (129, 64, True, (-1, -1), 0.5),
]


def _seed(*case) -> int:
    """A seed per test case, the same in every process (str hashes are salted per process)."""
    return zlib.crc32(repr(case).encode())


def _mask(causal, window, softcap):
    return MaskOptions.of(causal=causal, window_size=window, softcap=softcap)


def _inputs(seed, nq, nk, d, dtype, b=2, h=3):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of(dtype), scale=INPUT_SCALE)
    dout, _, _ = random_qkv(rng, b, nq, 1, h, d, dtype_of(dtype))
    return q, k, v, dout


def _keep_scale(seed, b, h, nq, nk, p):
    import cupy

    return cupy.asarray(dropout_keep_mask(seed, b, h, nq, nk, p).astype(np.float64) * dropout_scale(p))


def _poisoned_forward(fwd, q, k, v, mask, **kw):
    import cupy

    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
    return fwd(q, k, v, mask=mask, out=out, lse=lse, **kw)


def _check_forward(out, lse, q, k, v, mask, d, keep_scale=None):
    import cupy

    assert not bool(cupy.isnan(out.astype(cupy.float32)).any()) and not bool(cupy.isnan(lse).any())
    scale = 1 / math.sqrt(d)
    err, pt, allowed = fa_rule(out, q, k, v, mask, scale, keep_scale=keep_scale)
    assert err <= allowed, f"max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
    _, lse_ref = naive(q, k, v, mask, scale, cupy.float64)  # lse of the capped (undropped) scores
    finite = cupy.isfinite(lse_ref)
    assert bool((cupy.isfinite(lse) == finite).all())
    if bool(finite.any()):
        assert float(cupy.abs(lse.astype(cupy.float64) - lse_ref)[finite].max()) < 2e-3
    return allowed


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk,causal,window,softcap", CASES)
def test_softcap_forward(nq, nk, causal, window, softcap, d, dtype, backend):  # noqa: F811
    import cupy
    import cuflash
    from cuflash import _forward

    mask = _mask(causal, window, softcap)
    q, k, v, _ = _inputs(_seed(nq, nk, causal, window, softcap, d, dtype), nq, nk, d, dtype)
    out, lse = _poisoned_forward(_forward.forward, q, k, v, mask, backend=backend)
    allowed = _check_forward(out, lse, q, k, v, mask, d)
    # the cap really acts where it is strong: the plain attention's output is far off
    if softcap <= 5.0:
        err_plain, _, _ = fa_rule(out, q, k, v, _mask(causal, window, 0.0), 1 / math.sqrt(d))
        assert err_plain > 4 * allowed
    # the public entry point, same bits
    api = cuflash.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, backend=backend)
    assert bool((api.view(cupy.uint16) == out.view(cupy.uint16)).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk,causal,window,softcap", CASES[::2])
def test_softcap_forward_v1(nq, nk, causal, window, softcap, d, dtype):
    from cuflash import _forward_v1

    mask = _mask(causal, window, softcap)
    q, k, v, _ = _inputs(_seed(nq, nk, causal, window, softcap, d, dtype, "v1"), nq, nk, d, dtype)
    out, lse = _poisoned_forward(_forward_v1.forward_v1, q, k, v, mask)
    _check_forward(out, lse, q, k, v, mask, d)


@pytest.mark.parametrize("algorithm", ["v2@sm80", "v2@sm90", "v1"])
@pytest.mark.parametrize("dtype,d,nq,nk,causal,window,softcap,p", [
    ("bfloat16", 64, 113, 203, True, (-1, -1), 5.0, 0.17),
    ("float16", 128, 203, 113, False, (50, 50), 2.0, 0.3),
    ("bfloat16", 128, 256, 256, True, (64, 0), 10.0, 0.1),
])
def test_softcap_forward_with_dropout(algorithm, dtype, d, nq, nk, causal, window, softcap, p):
    """Dropout composes with softcap (FlashAttention 2 refuses the pair; the kernels here take it)."""
    import cuflash

    name, _, bk = algorithm.partition("@")
    if bk and backend_unavailable(bk):
        pytest.skip(f"{bk} forward not on this GPU: {backend_unavailable(bk)}")
    mask, seed = _mask(causal, window, softcap), 4321 + nq
    q, k, v, _ = _inputs(nq * 7 + nk, nq, nk, d, dtype)
    out, lse = cuflash.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, dropout_p=p, seed=seed,
                                 return_lse=True, algorithm=name, **({"backend": bk} if bk else {}))
    _check_forward(out, lse, q, k, v, mask, d, keep_scale=_keep_scale(seed, 2, 3, nq, nk, p))


BWD_CASES = [  # (nq, nk, causal, window, softcap, dropout p)
    (256, 256, False, (-1, -1), 5.0, 0.0), (113, 203, True, (-1, -1), 2.0, 0.0), (203, 113, True, (-1, -1), 30.0, 0.0),
    (1000, 1000, True, (64, 0), 5.0, 0.0), (300, 517, False, (100, 7), 1.0, 0.0), (1, 239, False, (-1, -1), 5.0, 0.0),
    (113, 203, True, (-1, -1), 5.0, 0.17), (256, 256, False, (32, 32), 2.0, 0.3),
]


@pytest.mark.parametrize("bwd", ["sm80", "sm80-deterministic", "sm90"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk,causal,window,softcap,p", BWD_CASES)
def test_softcap_backward(nq, nk, causal, window, softcap, p, d, dtype, bwd):
    import cupy
    from cuflash import _backward, _forward, device

    if bwd == "sm90":
        if tuple(device.query(0).cc) != (9, 0):
            pytest.skip("the sm90 backward needs cc 9.0")
    mask, seed = _mask(causal, window, softcap), 99 + nq
    q, k, v, dout = _inputs(_seed(nq, nk, causal, window, softcap, p, d, dtype, "bwd"), nq, nk, d, dtype)
    drop = dict(dropout_p=p, seed=seed) if p else {}
    out, lse = _forward.forward(q, k, v, mask=mask, **drop)
    grads = _backward.backward(dout, q, k, v, out, lse, mask=mask, deterministic=bwd == "sm80-deterministic",
                               backend="sm90" if bwd == "sm90" else None, **drop)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert not bool(cupy.isnan(g.astype(cupy.float32)).any())
    z = _keep_scale(seed, 2, 3, nq, nk, p) if p else None
    res = fa_rule_grads(grads, q, k, v, dout, mask, 1 / math.sqrt(d), keep_scale=z)
    for name, (err, pt, allowed) in res.items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
    if softcap <= 2.0 and not p:
        # the derivative really acts: the plain attention's gradients (same forward) are far off
        plain = fa_rule_grads(grads, q, k, v, dout, _mask(causal, window, 0.0), 1 / math.sqrt(d))
        assert plain["dq"][0] > 4 * res["dq"][2]


def test_softcap_deterministic_backward_is_bitwise_reproducible():
    from cuflash import _backward, _forward

    mask = _mask(True, (-1, -1), 5.0)
    q, k, v, dout = _inputs(5, 300, 300, 64, "bfloat16")
    out, lse = _forward.forward(q, k, v, mask=mask)
    a = _backward.backward(dout, q, k, v, out, lse, mask=mask, deterministic=True)
    b = _backward.backward(dout, q, k, v, out, lse, mask=mask, deterministic=True)
    for x, y in zip(a, b):
        assert bool((x.view("uint16") == y.view("uint16")).all())


def test_softcap_through_torch_autograd():
    """The torch op carries softcap (schema `float softcap=0.0`): forward and autograd's backward are
    the CuPy path's bits."""
    torch = pytest.importorskip("torch")
    import cupy
    import cuflash

    q, k, v, dout = _inputs(17, 200, 300, 64, "float16", b=1, h=2)
    t = lambda x: torch.from_dlpack(x.copy()).requires_grad_(True)
    qt, kt, vt = t(q), t(k), t(v)
    out_t = cuflash.attention(qt, kt, vt, causal=True, softcap=5.0)
    out_t.backward(torch.from_dlpack(dout.copy()))
    torch.cuda.synchronize()
    out, lse = cuflash.attention(q, k, v, causal=True, softcap=5.0, return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, softcap=5.0)
    assert bool((cupy.from_dlpack(out_t.detach()).view(cupy.uint16) == out.view(cupy.uint16)).all())
    for gt, g in zip((qt.grad, kt.grad, vt.grad), grads):  # dQ's fp32 atomics may order differently: an ulp or so
        g32 = g.astype(cupy.float32)
        diff = float(cupy.abs(cupy.from_dlpack(gt).astype(cupy.float32) - g32).max())
        assert diff <= 1e-2 * float(cupy.abs(g32).max()) + 1e-3


@pytest.mark.parametrize("bwd", ["sm80", "sm90"])
@pytest.mark.parametrize("heads_kv", [2, 1])  # GQA 6/2, MQA 6/1
def test_softcap_with_gqa(heads_kv, bwd, backend):  # noqa: F811
    """GQA/MQA compose with softcap: forward on every forward backend, backward on both dK/dV kernels."""
    import cupy
    from cuflash import _backward, _forward, device

    if bwd == "sm90" and tuple(device.query(0).cc) != (9, 0):
        pytest.skip("the sm90 backward needs cc 9.0")
    mask, d = _mask(True, (-1, -1), 5.0), 128
    rng = np.random.default_rng(_seed("gqa", heads_kv, bwd, backend))
    q, k, v = random_qkv(rng, 2, 203, 300, 6, d, dtype_of("bfloat16"), scale=INPUT_SCALE, heads_kv=heads_kv)
    dout, _, _ = random_qkv(rng, 2, 203, 1, 6, d, dtype_of("bfloat16"))
    out, lse = _poisoned_forward(_forward.forward, q, k, v, mask, backend=backend)
    _check_forward(out, lse, q, k, v, mask, d)
    grads = _backward.backward(dout, q, k, v, out, lse, mask=mask, backend=bwd)
    assert grads[1].shape == k.shape and not bool(cupy.isnan(grads[1].astype(cupy.float32)).any())
    for name, (err, pt, allowed) in fa_rule_grads(grads, q, k, v, dout, mask, 1 / math.sqrt(d)).items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
