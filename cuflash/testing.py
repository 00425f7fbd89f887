"""The shared accuracy oracle: inputs, float64 references on the GPU, and FlashAttention's 2x rule.

Used by the GPU tests, the scripts (sweeps, overhead, sanitizer cases) and anyone checking a kernel
change. A kernel's error against a float64 reference must stay within `factor` (2) times the error
of a plain same-dtype attention (PyTorch's math path in bf16/fp16) against the same reference, plus
2 ulps at the output's magnitude (FA3's data-derived floor). The mask is cuflash.reference's;
a MaskOptions given as `causal` also brings its softcap (scores c tanh(scale q.k / c)).

GQA/MQA (k, v with fewer heads than q, dividing them): both sides repeat each k/v head for its
group of query heads and sum the repeated heads' dK, dV over the group (the same-dtype side rounds
each head's gradient, then the sum, as autograd through a 16-bit repeat_interleave does).

CuPy is imported lazily, so importing this module costs nothing on a machine without a GPU.
"""
from __future__ import annotations

import numpy as np

from .reference import alibi_bias, visible


def bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def dtype_of(name: str):
    """The CuPy dtype of "float16" / "bfloat16"."""
    import cupy

    return cupy.float16 if name == "float16" else bf16()


def random_qkv(rng, b, nq, nk, h, d, dtype, scale=1.0, heads_kv=None):
    """Fresh random normal q, k, v (never zeros) as CuPy arrays of `dtype`; k and v with `heads_kv`
    heads (GQA/MQA; default h)."""
    import cupy

    mk = lambda n, hh: cupy.asarray((rng.standard_normal((b, n, hh, d)) * scale).astype(np.float32)).astype(dtype)
    hkv = h if heads_kv is None else heads_kv
    return mk(nq, h), mk(nk, hkv), mk(nk, hkv)


def repeat_kv(x, heads: int):
    """(b, n, heads_kv, d) -> (b, n, heads, d) on the GPU: each k/v head repeated for its group of
    query heads (query head h reads k/v head h // group), as cuflash.reference.repeat_kv."""
    import cupy

    group = heads // x.shape[2]
    return x if group == 1 else cupy.repeat(x, group, axis=2)


def sum_groups(x, heads_kv: int):
    """(b, n, heads, d) -> (b, n, heads_kv, d): the sum over each group of consecutive heads."""
    b, n, h, d = x.shape
    return x if h == heads_kv else x.reshape(b, n, heads_kv, h // heads_kv, d).sum(axis=3)


def _rounder(compute_dtype, round_dtype):
    if round_dtype is None:
        return lambda x: x
    return lambda x: x.astype(round_dtype).astype(compute_dtype)


def _index_grids(shape):
    """(b, h, q_idx, kv_idx) as broadcastable CuPy int arrays over scores of `shape` (b, h, nq, nk)."""
    import cupy

    return tuple(cupy.arange(n).reshape([n if i == j else 1 for j in range(4)]) for i, n in enumerate(shape))


def _masked_scores(qf, kf, causal, scale, rnd, with_tanh=False, alibi_slopes=None, mods=None):
    """Scores scale Q K^T, softcapped (c tanh(. / c)) when `causal` is a MaskOptions with softcap c
    (the same-dtype side rounds s / c, the tanh and its product with c, as a 16-bit PyTorch
    computation would), then masked (-inf). with_tanh: also the tanh (None without softcap), for
    the gradient's 1 - tanh^2."""
    import cupy

    s = rnd(cupy.matmul(qf, kf.transpose(0, 1, 3, 2))) * scale
    c = float(getattr(causal, "softcap", 0.0) or 0.0)
    t = None
    if c:
        t = rnd(cupy.tanh(rnd(s / c)))
        s = rnd(t * c)
    if mods is not None:  # a user modification (cuflash.ScoreMod) as CuPy functions over index grids
        score_fn, mask_fn = mods[:2]
        grids = _index_grids(s.shape)
        if score_fn is not None:
            s = rnd(score_fn(s, *grids).astype(s.dtype))
        if mask_fn is not None:
            s = cupy.where(cupy.broadcast_to(mask_fn(*grids), s.shape), s, -cupy.inf)
    if alibi_slopes is not None:  # ALiBi after the cap (cuflash.reference.alibi_bias), in the compute dtype
        b, h, nq, nk = s.shape
        bias = alibi_bias(nq, nk, cupy.asnumpy(alibi_slopes), b, h, getattr(causal, "alignment", "bottom_right"))
        s = rnd(s + cupy.asarray(bias).astype(s.dtype))
    ok = visible(*s.shape[-2:], causal)  # causal: a bool or a cuflash.mask.MaskOptions (with its window)
    if ok is not None:
        s = cupy.where(cupy.asarray(ok), s, -cupy.inf)
    return (s, t) if with_tanh else s


def naive(q, k, v, causal, scale, compute_dtype, round_dtype=None, keep_scale=None, alibi_slopes=None, mods=None):
    """softmax(scale Q K^T) V on the GPU in `compute_dtype`, bottom-right causal (`causal` may be a
    cuflash.mask.MaskOptions: its window, alignment and softcap apply). k, v may have
    fewer heads than q, dividing them (GQA/MQA: repeated for each group of query heads).

    With round_dtype set, S, P and O are rounded to it the way a plain same-dtype attention (e.g.
    PyTorch's math path in bf16) would; this is the "pt" side of the FlashAttention 2x rule.
    keep_scale: dropout as Z = keep_mask * scale, a (b, h, nq, nk) CuPy array: O = (P o Z) V (the
    same-dtype side rounds P o Z, as dropout applied to a bf16 P would); lse stays undropped.
    Returns (out, lse) in compute_dtype; fully masked rows give 0 and -inf; a NaN (or +inf) score
    a row sees makes its out and lse NaN, as in cuflash.reference.
    mods: a user modification as (score_fn, mask_fn), either None: score_fn(s, b, h, q_idx, kv_idx)
    -> the new scores and mask_fn(b, h, q_idx, kv_idx) -> visible, CuPy functions over broadcastable
    index grids, applied after softcap and before ALiBi and the mask (cuflash.ScoreMod's order).
    """
    import cupy

    rnd = _rounder(compute_dtype, round_dtype)
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])  # GQA/MQA: one k/v head per query head
    qf, kf, vf = (x.astype(compute_dtype).transpose(0, 2, 1, 3) for x in (q, k, v))  # b h n d
    s = _masked_scores(qf, kf, causal, scale, rnd, alibi_slopes=alibi_slopes, mods=mods)
    m = s.max(axis=-1, keepdims=True)
    m_safe = cupy.where(cupy.isneginf(m), 0, m)
    e = cupy.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    p = rnd(e / cupy.where(l != 0, l, 1))
    if keep_scale is not None:
        p = rnd(p * keep_scale.astype(compute_dtype))
    o = rnd(cupy.matmul(p, vf))
    lse = cupy.where(l[..., 0] != 0, cupy.log(cupy.where(l[..., 0] != 0, l[..., 0], 1)) + m_safe[..., 0], -cupy.inf)
    return o.transpose(0, 2, 1, 3), lse


def naive_grads(q, k, v, dout, causal, scale, compute_dtype, round_dtype=None, keep_scale=None, alibi_slopes=None,
                mods=None):
    """(dq, dk, dv) of softmax(scale Q K^T) V for upstream dout, bottom-right causal, on the GPU.
    k, v may have fewer heads than q (GQA/MQA): dk, dv then have theirs (sums over each group).

    With round_dtype set, every matmul result and P are rounded to it as a plain same-dtype
    autograd would (the "pt" side of the 2x rule). Rows that see no key get zero gradient.
    keep_scale: dropout as Z = keep_mask * scale, a (b, h, nq, nk) CuPy array: O = (P o Z) V,
    dV = (P o Z)^T dO, dS = P o (dP o Z - D) with dP = dO V^T and D = rowsum(dO o O).
    alibi_slopes: ALiBi's bias on the scores (after softcap; it passes dS through unchanged).
    mods: a user modification (score_fn, mask_fn, grad_fn) (naive's, plus grad_fn(s, b, h, q_idx,
    kv_idx) = d score_fn / d s), dS taking grad_fn at the unmodified scaled score (0 where P is 0).
    """
    import cupy

    rnd = _rounder(compute_dtype, round_dtype)
    heads_kv = k.shape[2]
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])  # GQA/MQA: dK, dV summed back below
    qf, kf, vf, dof = (x.astype(compute_dtype).transpose(0, 2, 1, 3) for x in (q, k, v, dout))  # b h n d
    s, t = _masked_scores(qf, kf, causal, scale, rnd, with_tanh=True, alibi_slopes=alibi_slopes, mods=mods)
    m = s.max(axis=-1, keepdims=True)
    e = cupy.exp(s - cupy.where(cupy.isneginf(m), 0, m))
    l = e.sum(axis=-1, keepdims=True)
    p = rnd(e / cupy.where(l != 0, l, 1))
    z = None if keep_scale is None else keep_scale.astype(compute_dtype)
    pz = p if z is None else rnd(p * z)
    o = rnd(cupy.matmul(pz, vf))
    dv = rnd(cupy.matmul(pz.transpose(0, 1, 3, 2), dof))
    dp = rnd(cupy.matmul(dof, vf.transpose(0, 1, 3, 2)))
    if z is not None:
        dp = rnd(dp * z)
    delta = (dof * o).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - delta))
    if t is not None:  # softcap: through c tanh(x / c), the factor 1 - tanh^2 (p = 0 where masked)
        ds = rnd(ds * (1 - t * t))
    if mods is not None and len(mods) > 2 and mods[2] is not None:  # a user score snippet's derivative
        raw = rnd(cupy.matmul(qf, kf.transpose(0, 1, 3, 2))) * scale
        g = mods[2](raw, *_index_grids(raw.shape)).astype(ds.dtype)
        ds = rnd(cupy.where(p != 0, ds * g, 0))
    dq = rnd(cupy.matmul(ds, kf)) * scale
    dk = rnd(cupy.matmul(ds.transpose(0, 1, 3, 2), qf)) * scale
    back = lambda x: x.transpose(0, 2, 1, 3)
    if heads_kv == q.shape[2]:
        return back(dq), back(dk), back(dv)
    return back(dq), rnd(sum_groups(back(dk), heads_kv)), rnd(sum_groups(back(dv), heads_kv))


def _allowed(got, ref, pt, factor):
    """(kernel error, same-dtype error, allowed) of `got` against the float64 `ref`."""
    import cupy

    err = float(cupy.abs(got.astype(cupy.float64) - ref).max())
    pt_err = float(cupy.abs(pt.astype(cupy.float64) - ref).max())
    r = ref.astype(got.dtype).astype(cupy.float64)
    atol = 2 * float(cupy.abs((r + 0.3).astype(got.dtype).astype(cupy.float64) - 0.3 - r).max())
    return err, pt_err, factor * pt_err + atol


def fa_rule(out, q, k, v, causal, scale, factor=2.0, keep_scale=None, alibi_slopes=None, mods=None):
    """(kernel error, same-dtype error, allowed) by FlashAttention's rule against a float64 reference.

    keep_scale: dropout's Z = keep_mask * scale (b, h, nq, nk), applied on both sides (see naive).
    k, v may have fewer heads than q (GQA/MQA), as the kernels take them. alibi_slopes: ALiBi's
    (heads,) or (batch, heads) slopes, on both sides. mods: a user modification's (score_fn, mask_fn)
    (see naive), on both sides.
    """
    import cupy

    ref, _ = naive(q, k, v, causal, scale, cupy.float64, keep_scale=keep_scale, alibi_slopes=alibi_slopes, mods=mods)
    pt, _ = naive(q, k, v, causal, scale, cupy.float32, round_dtype=out.dtype, keep_scale=keep_scale,
                  alibi_slopes=alibi_slopes, mods=mods)
    return _allowed(out, ref, pt, factor)


def fa_rule_grads(grads, q, k, v, dout, causal, scale, factor=2.0, keep_scale=None, alibi_slopes=None, mods=None):
    """Per gradient name ("dq", "dk", "dv"): (kernel error, same-dtype error, allowed), as fa_rule
    does for the output. keep_scale: dropout's Z, applied on both sides (see naive_grads).
    GQA/MQA: k, v (and the kernel's dk, dv) with fewer heads than q; both references sum dK, dV
    over each group (naive_grads)."""
    import cupy

    ref = naive_grads(q, k, v, dout, causal, scale, cupy.float64, keep_scale=keep_scale, alibi_slopes=alibi_slopes,
                      mods=mods)
    pt = naive_grads(q, k, v, dout, causal, scale, cupy.float32, round_dtype=q.dtype, keep_scale=keep_scale,
                     alibi_slopes=alibi_slopes, mods=mods)
    return {name: _allowed(g, r, p, factor) for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref, pt)}


def backend_unavailable(backend: str, device_id: int = 0) -> str | None:
    """Why the forward `backend` ("sm80", "sm90") cannot run on this GPU at all, or None: for the
    GPU tests, which run their matrix on every backend the device has (a call may still fall back
    for its own reasons: families.choose)."""
    from . import _compile, device, families, tma

    fam = next(f for f in families.FORWARDS if f.backend == backend)
    props = device.query(device_id)
    why = fam.device_problem(props)
    if why is None and not (_compile.kernel_dir() / fam.header).is_file():
        why = f"kernels_cu/{fam.header} is not there"
    if why is None and fam is families.FWD_SM90:
        why = tma.bindings_problem()
    return why


def block_mask_reference(keep, block_q: int, block_k: int, cell: int = 16):
    """The NumPy twin of a BlockMask (kernels_cu/attn/block_mask.cuh) from a boolean keep array
    (batch, heads, seqlen_q, seqlen_k) (the mask snippet's value per pair): (cells, full, counts,
    index) with cells / full bool (batch * heads, ceil(seqlen_q / cell), ceil(seqlen_k / cell)) (some
    / every pair of the cell inside the sequences kept) and the lists of tiles block_q x block_k as
    BlockMask.lists gives them: counts (batch * heads, m_blocks), index (batch * heads, m_blocks,
    n_blocks), each entry j | FULL_BLOCK where all the block's cells are full, unused entries 0."""
    from .block_mask import FULL_BLOCK

    import numpy as np

    keep = np.asarray(keep, dtype=bool)
    b, h, nq, nk = keep.shape
    qc, kc = -(-nq // cell), -(-nk // cell)
    padded = np.zeros((b * h, qc * cell, kc * cell), dtype=bool)
    padded[:, :nq, :nk] = keep.reshape(b * h, nq, nk)
    cells = padded.reshape(b * h, qc, cell, kc, cell).any(axis=(2, 4))
    inside = np.zeros_like(padded)
    inside[:, :nq, :nk] = True
    full = cells & (padded | ~inside).reshape(b * h, qc, cell, kc, cell).all(axis=(2, 4))
    mb, nb = -(-nq // block_q), -(-nk // block_k)
    rb, cb = block_q // cell, block_k // cell
    counts = np.zeros((b * h, max(mb, 1)), dtype=np.int32)
    index = np.zeros((b * h, max(mb, 1), max(nb, 1)), dtype=np.int32)
    for bh in range(b * h):
        for i in range(mb):
            live = [j | (FULL_BLOCK if full[bh, i * rb:(i + 1) * rb, j * cb:(j + 1) * cb].all() else 0)
                    for j in range(nb) if cells[bh, i * rb:(i + 1) * rb, j * cb:(j + 1) * cb].any()]
            counts[bh, i] = len(live)
            index[bh, i, :len(live)] = live
    return cells, full, counts, index
