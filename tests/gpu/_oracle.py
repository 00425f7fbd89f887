"""GPU-side helpers for the FlashAttention accuracy rule (float64 reference on the device)."""
from __future__ import annotations

import numpy as np


def bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def dtype_of(name: str):
    import cupy

    return cupy.float16 if name == "float16" else bf16()


def random_qkv(rng, b, nq, nk, h, d, dtype, scale=1.0):
    """Fresh random normal q, k, v (never zeros) as CuPy arrays of `dtype`."""
    import cupy

    mk = lambda n: cupy.asarray((rng.standard_normal((b, n, h, d)) * scale).astype(np.float32)).astype(dtype)
    return mk(nq), mk(nk), mk(nk)


def naive(q, k, v, causal, scale, compute_dtype, round_dtype=None, keep_scale=None):
    """softmax(scale Q K^T) V on the GPU in `compute_dtype`, bottom-right causal.

    With round_dtype set, S, P and O are rounded to it the way a plain same-dtype attention (e.g.
    PyTorch's math path in bf16) would; this is the "pt" side of the FlashAttention 2x rule.
    keep_scale: dropout as Z = keep_mask * scale, a (b, h, nq, nk) CuPy array: O = (P o Z) V (the
    same-dtype side rounds P o Z, as dropout applied to a bf16 P would); lse stays undropped.
    Returns (out, lse) in compute_dtype; fully masked rows give 0 and -inf.
    """
    import cupy

    rnd = (lambda x: x.astype(round_dtype).astype(compute_dtype)) if round_dtype is not None else (lambda x: x)
    qf, kf, vf = (x.astype(compute_dtype).transpose(0, 2, 1, 3) for x in (q, k, v))  # b h n d
    s = rnd(cupy.matmul(qf, kf.transpose(0, 1, 3, 2))) * scale
    nq, nk = s.shape[-2:]
    if causal:
        allowed = cupy.arange(nk)[None, :] <= cupy.arange(nq)[:, None] + (nk - nq)
        s = cupy.where(allowed, s, -cupy.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = cupy.where(cupy.isfinite(m), m, 0)
    e = cupy.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    p = rnd(e / cupy.where(l > 0, l, 1))
    if keep_scale is not None:
        p = rnd(p * keep_scale.astype(compute_dtype))
    o = rnd(cupy.matmul(p, vf))
    lse = cupy.where(l[..., 0] > 0, cupy.log(cupy.where(l[..., 0] > 0, l[..., 0], 1)) + m_safe[..., 0], -cupy.inf)
    return o.transpose(0, 2, 1, 3), lse


def fa_rule(out, q, k, v, causal, scale, factor=2.0, keep_scale=None):
    """(kernel error, same-dtype error, allowed) by FlashAttention's rule against a float64 reference.

    allowed = factor * same-dtype error + 2 ulps at the output's magnitude (FA3's data-derived floor).
    keep_scale: dropout's Z = keep_mask * scale (b, h, nq, nk), applied on both sides (see naive).
    """
    import cupy

    ref, _ = naive(q, k, v, causal, scale, cupy.float64, keep_scale=keep_scale)
    pt, _ = naive(q, k, v, causal, scale, cupy.float32, round_dtype=out.dtype, keep_scale=keep_scale)
    err = float(cupy.abs(out.astype(cupy.float64) - ref).max())
    pt_err = float(cupy.abs(pt.astype(cupy.float64) - ref).max())
    r = ref.astype(out.dtype).astype(cupy.float64)
    atol = 2 * float(cupy.abs((r + 0.3).astype(out.dtype).astype(cupy.float64) - 0.3 - r).max())
    return err, pt_err, factor * pt_err + atol


def fa_rule_grads(grads, dout, q, k, v, causal, scale, factor=2.0):
    """[(name, kernel error, same-dtype error, allowed)] for (dq, dk, dv): the list form (dout first)
    of tests/gpu/_oracle_bwd.fa_rule_grads, which holds the backward reference."""
    from tests.gpu._oracle_bwd import fa_rule_grads as rule

    return [(name, *r) for name, r in rule(grads, q, k, v, dout, causal, scale, factor).items()]
