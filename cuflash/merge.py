"""Merging partial attention results by their log-sum-exp (split-KV decoding, ring attention).

Attention of queries over a key set that is split into parts K_1 .. K_n (each part's keys, values
and mask) is exactly recovered from the parts' results (out_i, lse_i) (issue 17, and the ring
attention of issue 15):

    lse = log sum_i exp(lse_i)                       (-inf where every part saw no key)
    out = sum_i exp(lse_i - lse) out_i               (0 where lse = -inf)

because out_i = sum_j exp(s_ij - lse_i) v_j over part i. The sum runs in float32 (float64 for
float64 inputs) with the running maximum subtracted first, so no exp overflows. NaN in an lse_i
(a NaN row in that part) propagates to the row, as attention itself does.

`merge_attention` works on NumPy (the reference), CuPy and torch arrays (torch: differentiable
through autograd, since it is plain tensor arithmetic), each with its own array module. It is a
handful of elementwise kernels today; a fused kernel is for when split-KV decoding needs it.
"""
from __future__ import annotations


def _module(x):
    """(xp, kind) for an array: numpy, cupy or torch."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        import torch

        return torch, "torch"
    if mod == "cupy":
        import cupy

        return cupy, "cupy"
    if mod == "numpy":
        import numpy

        return numpy, "numpy"
    raise TypeError(f"outs and lses must be NumPy, CuPy or torch arrays, got {type(x).__module__}.{type(x).__qualname__}")


def _check(outs, lses):
    if isinstance(outs, (str, bytes)) or not hasattr(outs, "__len__") or not hasattr(lses, "__len__"):
        raise TypeError("outs and lses must be sequences of arrays (one per part)")
    outs, lses = list(outs), list(lses)
    if not outs:
        raise ValueError("outs must hold at least one partial result")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have one entry per part, got {len(outs)} and {len(lses)}")
    xp, kind = _module(outs[0])
    for name, xs in (("outs", outs), ("lses", lses)):
        for i, x in enumerate(xs):
            if _module(x)[1] != kind:
                raise TypeError(f"{name}[{i}] is a {type(x).__module__} array, outs[0] a {kind} one: use one kind")
    shape = tuple(outs[0].shape)
    if len(shape) != 4:
        raise ValueError(f"outs[0] must have 4 dimensions (batch, seqlen_q, heads, head_dim), got shape {shape}")
    b, nq, h, _ = shape
    for i, (o, lse) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != shape:
            raise ValueError(f"outs[{i}] has shape {tuple(o.shape)}, outs[0] {shape}: every part has the same queries")
        if tuple(lse.shape) != (b, h, nq):
            raise ValueError(f"lses[{i}] must have shape (batch, heads, seqlen_q) = {(b, h, nq)}, got {tuple(lse.shape)}")
        if "float" not in str(lse.dtype):
            raise TypeError(f"lses[{i}] must be a floating-point array, got dtype {lse.dtype}")
        if "float" not in str(o.dtype) and "bfloat16" not in str(o.dtype):
            raise TypeError(f"outs[{i}] must be a floating-point array, got dtype {o.dtype}")
    return outs, lses, xp, kind


def merge_attention(outs, lses, *, out_dtype=None):
    """(out, lse) of attention over the union of key parts, from each part's (out_i, lse_i).

    outs: a sequence of (batch, seqlen_q, heads, head_dim) arrays, one per part, the same queries;
    lses: their (batch, heads, seqlen_q) log-sum-exps (float32, as cuflash.attention(...,
    return_lse=True) returns; a part that saw no key of a row has -inf there). Arrays of one kind:
    NumPy, CuPy or torch (on one device). out has outs[0]'s dtype unless out_dtype is given; lse
    is float32 (float64 if the lses are). A part may be given with an lse of -inf everywhere (it
    contributes nothing).
    """
    outs, lses, xp, kind = _check(outs, lses)
    f64 = any("float64" in str(x.dtype) for x in lses)
    if kind == "torch":
        acc_t = xp.float64 if f64 else xp.float32
        lse_all = xp.stack([x.to(acc_t) for x in lses])
        m = lse_all.amax(dim=0)
    else:
        acc_t = xp.float64 if f64 else xp.float32
        lse_all = xp.stack([x.astype(acc_t) for x in lses])
        m = lse_all.max(axis=0)
    finite_m = xp.where(xp.isneginf(m), xp.zeros_like(m), m)  # rows no part attended: e^(-inf - 0) = 0
    w = xp.exp(lse_all - finite_m[None])                        # (parts, b, h, nq)
    s = w.sum(0)
    attended = s != 0                                           # NaN s (a NaN lse) stays NaN below
    safe_s = xp.where(attended, s, xp.ones_like(s))
    lse = xp.where(attended, finite_m + xp.log(safe_s), xp.full_like(s, -float("inf")))
    scale = xp.where(attended[None], w / safe_s[None], xp.zeros_like(w))  # (parts, b, h, nq)
    out = None
    for i, o in enumerate(outs):
        c = scale[i]
        c = c.permute(0, 2, 1)[..., None] if kind == "torch" else c.transpose(0, 2, 1)[..., None]
        term = (o.to(acc_t) if kind == "torch" else o.astype(acc_t)) * c
        out = term if out is None else out + term
    target = out_dtype if out_dtype is not None else outs[0].dtype
    out = out.to(target) if kind == "torch" else out.astype(target)
    return out, lse

