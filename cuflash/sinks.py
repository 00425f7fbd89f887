"""Attention sinks (issue 13; gpt-oss's learned per-head sinks, transformers' `s_aux`): each query
head h has a logit `sinks[h]` that joins every row's softmax as one more column with no value:

    P = softmax([S, sink_h]) over the keys and the sink,  out = P[:, keys] V.

No kernel change is needed, exactly: with L = logsumexp(S) the kernels' lse and O their output,

    lse' = log(e^L + e^sink) = logaddexp(L, sink),    out' = O e^(L - lse'),

and the backward is the ordinary one run with (out', lse') in place of (O, L): P' = exp(S - lse')
are the sink softmax's probabilities of the keys, and D' = rowsum(dout o out') is sum_j P'_j dP_j
over the keys plus the sink's term, which is 0 (no value). The sink's own gradient is

    d sinks[h] = -sum over batch and queries of e^(sink_h - lse') D'.

Rows that see no key have L = -inf: out' = 0 and lse' = sink. Works on NumPy, CuPy and torch
arrays (each with its own array module); the rescale runs in float32 and rounds out' once.
"""
from __future__ import annotations

from .merge import _module


def check(sinks, heads: int, q) -> None:
    """sinks: a 1-D floating array of `heads` entries, of q's framework (and device)."""
    qkind = type(q).__module__.split(".")[0]
    kind = type(sinks).__module__.split(".")[0]
    if kind != qkind or not hasattr(sinks, "dtype") or not hasattr(sinks, "shape"):
        raise TypeError(f"sinks must be a {qkind} array like q, got {type(sinks).__module__}.{type(sinks).__qualname__}")
    shape = tuple(sinks.shape)
    if shape != (heads,):
        raise ValueError(f"sinks must have shape (heads={heads},) (one logit per query head), got {shape}")
    if "float" not in str(sinks.dtype):
        raise TypeError(f"sinks must be floating point, got {sinks.dtype}")
    dev, qdev = getattr(sinks, "device", None), getattr(q, "device", None)
    if kind in ("cupy", "torch") and str(dev) != str(qdev):
        raise ValueError(f"sinks is on {dev}, q on {qdev}")


def _f32(x, xp, kind):
    """x in at least float32 (16-bit arrays upcast; float64 kept: the NumPy reference's precision)."""
    if x.dtype.itemsize >= 4:
        return x
    return x.float() if kind == "torch" else x.astype(xp.float32)


def apply(out, lse, sinks):
    """(out', lse'): out (batch, seqlen_q, heads, d) and lse (batch, heads, seqlen_q) of attention
    over the keys, rescaled to the softmax that includes the sinks."""
    xp, kind = _module(out)
    s = _f32(sinks, xp, kind)[None, :, None]
    lse2 = xp.logaddexp(lse, s)
    w = xp.exp(lse - lse2)  # 0 where lse = -inf (a row without keys)
    w = w.transpose(1, 2)[..., None] if kind == "torch" else xp.transpose(w, (0, 2, 1))[..., None]
    out2 = _f32(out, xp, kind) * w
    return (out2.to(out.dtype) if kind == "torch" else out2.astype(out.dtype)), lse2


def grad(dout, out2, lse2, sinks):
    """d sinks (heads,) in sinks' dtype, from the output gradient and the sink-adjusted out', lse'."""
    xp, kind = _module(out2)
    d = (_f32(dout, xp, kind) * _f32(out2, xp, kind)).sum(-1)  # D' (batch, seqlen_q, heads)
    d = d.transpose(1, 2) if kind == "torch" else xp.transpose(d, (0, 2, 1))
    p_sink = xp.exp(_f32(sinks, xp, kind)[None, :, None] - lse2)
    g = -(p_sink * d).sum((0, 2)) if kind == "torch" else -(p_sink * d).sum(axis=(0, 2))
    return g.to(sinks.dtype) if kind == "torch" else g.astype(sinks.dtype)
