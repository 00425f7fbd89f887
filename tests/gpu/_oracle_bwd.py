"""Backward side of the FlashAttention accuracy rule: float64 gradients on the device."""
from __future__ import annotations


def naive_grads(q, k, v, dout, causal, scale, compute_dtype, round_dtype=None, keep_scale=None):
    """(dq, dk, dv) of softmax(scale Q K^T) V for upstream dout, bottom-right causal, on the GPU.

    With round_dtype set, every matmul result and P are rounded to it as a plain same-dtype
    autograd would (the "pt" side of the 2x rule). Rows that see no key get zero gradient.
    keep_scale: dropout as Z = keep_mask * scale, a (b, h, nq, nk) CuPy array: O = (P o Z) V,
    dV = (P o Z)^T dO, dS = P o (dP o Z - D) with dP = dO V^T and D = rowsum(dO o O).
    """
    import cupy

    rnd = (lambda x: x.astype(round_dtype).astype(compute_dtype)) if round_dtype is not None else (lambda x: x)
    qf, kf, vf, dof = (x.astype(compute_dtype).transpose(0, 2, 1, 3) for x in (q, k, v, dout))  # b h n d
    s = rnd(cupy.matmul(qf, kf.transpose(0, 1, 3, 2))) * scale
    nq, nk = s.shape[-2:]
    if causal:
        allowed = cupy.arange(nk)[None, :] <= cupy.arange(nq)[:, None] + (nk - nq)
        s = cupy.where(allowed, s, -cupy.inf)
    m = s.max(axis=-1, keepdims=True)
    e = cupy.exp(s - cupy.where(cupy.isfinite(m), m, 0))
    l = e.sum(axis=-1, keepdims=True)
    p = rnd(e / cupy.where(l > 0, l, 1))
    z = None if keep_scale is None else keep_scale.astype(compute_dtype)
    pz = p if z is None else rnd(p * z)
    o = rnd(cupy.matmul(pz, vf))
    dv = rnd(cupy.matmul(pz.transpose(0, 1, 3, 2), dof))
    dp = rnd(cupy.matmul(dof, vf.transpose(0, 1, 3, 2)))
    if z is not None:
        dp = rnd(dp * z)
    delta = (dof * o).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - delta))
    dq = rnd(cupy.matmul(ds, kf)) * scale
    dk = rnd(cupy.matmul(ds.transpose(0, 1, 3, 2), qf)) * scale
    back = lambda x: x.transpose(0, 2, 1, 3)
    return back(dq), back(dk), back(dv)


def fa_rule_grads(grads, q, k, v, dout, causal, scale, factor=2.0, keep_scale=None):
    """Per gradient name: (kernel error, same-dtype error, allowed), as fa_rule does for the output.

    keep_scale: dropout's Z = keep_mask * scale (b, h, nq, nk), applied on both sides (see naive_grads).
    """
    import cupy

    ref = naive_grads(q, k, v, dout, causal, scale, cupy.float64, keep_scale=keep_scale)
    pt = naive_grads(q, k, v, dout, causal, scale, cupy.float32, round_dtype=q.dtype, keep_scale=keep_scale)
    res = {}
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref, pt):
        err = float(cupy.abs(g.astype(cupy.float64) - r).max())
        pt_err = float(cupy.abs(p.astype(cupy.float64) - r).max())
        rr = r.astype(g.dtype).astype(cupy.float64)
        atol = 2 * float(cupy.abs((rr + 0.3).astype(g.dtype).astype(cupy.float64) - 0.3 - rr).max())
        res[name] = (err, pt_err, factor * pt_err + atol)
    return res
