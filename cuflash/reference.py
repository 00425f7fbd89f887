"""Float64 NumPy reference implementations of attention: the oracle of every test.

Pure NumPy (no CuPy import), so it runs anywhere, CI included.

Layout is FlashAttention's: ``q`` is (B, N_q, H, d), ``k`` is (B, N_k, H_kv, d) and ``v`` (B, N_k,
H_kv, d_v) (d_v = d but for MLA-style calls); ``out`` and ``dout`` are (B, N_q, H, d_v);
``dq`` / ``dk`` / ``dv`` have the layout of the matching input, and the
log-sum-exp ``lse`` is (B, H, N_q). Everything is computed and returned in float64.

Grouped-query attention (GQA; MQA is H_kv = 1): H_kv divides H and query head h attends with
k/v head h // (H / H_kv). The oracle computes it from the definition, by repeating each k/v head
for its group of query heads (``repeat_kv``) and running multi-head attention; dK and dV of a k/v
head are the sums over its group of the repeated heads' gradients (``sum_groups``).

Notation follows the FlashAttention papers (Dao et al. 2022, Dao 2023):

    S = tau Q K^T,   P = softmax(S) (row-wise),   O = P V,   L = lse = log rowsum(e^S),

with tau = ``softmax_scale`` (default 1/sqrt(d)). Causal masking is aligned to the
bottom-right corner (FlashAttention >= 2.1): query row i may attend key j iff
j <= i + (N_k - N_q). When N_q > N_k the first N_q - N_k rows may attend nothing; such rows
have O = 0 exactly and L = -inf.

NaN and Inf follow PyTorch's softmax (and its SDPA math path): a NaN score, or a +inf one, in the
part of a row that the mask leaves visible makes that row's output and L NaN (masked entries are
replaced by -inf first, so a NaN in a key a row does not see does not reach it); a row whose visible
scores are all -inf is a row that attends nothing (O = 0, L = -inf, PyTorch >= 2.5 gives 0 too). V
enters through the product P V, where 0 x NaN = NaN: a NaN in V reaches every row of its (batch,
head) that attends anything, as in PyTorch's math path (the tiled models and the kernels only
multiply the key tiles a row block visits). The backward propagates the same way.

Softcap (Gemma 2; FlashAttention >= 2.6's ``softcap``): with c = ``softcap`` > 0 the scores are

    S = c tanh(tau Q K^T / c)

before the mask and the softmax (FlashAttention folds tau into the tanh's argument: it computes
tanh(Q K^T * (tau / c)) and scales the softmax by c, which is the same function); L is the
log-sum-exp of these capped scores. The backward's dS (with respect to S) is multiplied by the
tanh's derivative before the products with tau:

    T = tanh(tau Q K^T / c),   dS' = dS o (1 - T^2),   dQ = tau dS' K,   dK = tau dS'^T Q.

c = 0 (or None) is no softcap. If ``causal`` is a cuflash.mask.MaskOptions record, its softcap
applies unless ``softcap`` is given.

Dropout is described by an explicit boolean keep-mask of shape (B, H, N_q, N_k) (True =
kept) and its probability p: with Z = mask / (1 - p), O = (P o Z) V, while L stays the
log-sum-exp of the undropped scores, as in FlashAttention.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "causal_mask",
    "visible",
    "attention_naive",
    "attention_v1_tiled",
    "alibi_bias",
    "attention_v2_tiled",
    "attention_backward",
    "attention_backward_tiled",
    "repeat_kv",
    "sum_groups",
]


# --------------------------------------------------------------------------- helpers


def causal_mask(nq: int, nk: int) -> np.ndarray:
    """Bottom-right aligned causal mask M of shape (N_q, N_k): M_ij = (j <= i + N_k - N_q).

    True where attention is allowed. For N_q == N_k this is the lower triangle.
    """
    rows = np.arange(nq)[:, None]
    cols = np.arange(nk)[None, :]
    return cols <= rows + (nk - nq)


def visible(nq: int, nk: int, causal=False, window_size=(-1, -1), alignment="bottom_right") -> np.ndarray | None:
    """Where attention is allowed, (N_q, N_k) bool, or None for everything: causal mask and/or
    sliding window (left, right; -1 = no limit) around query i's diagonal, key i + N_k - N_q
    (bottom_right, FlashAttention's) or key i (top_left, PyTorch SDPA's is_causal). `causal` may
    also be a cuflash.mask.MaskOptions (then it carries the window and the alignment). Written
    independently of the kernels' canonical geometry, which it checks."""
    if not isinstance(causal, (bool, np.bool_, int)):  # a MaskOptions record
        causal, window_size, alignment = causal.causal, causal.window_size, causal.alignment
    left, right = window_size
    if not causal and left < 0 and right < 0:
        return None
    rows = np.arange(nq)[:, None] + ((nk - nq) if alignment == "bottom_right" else 0)
    cols = np.arange(nk)[None, :]
    ok = np.ones((nq, nk), dtype=bool)
    if causal:
        ok &= cols <= rows
    if right >= 0:
        ok &= cols <= rows + right
    if left >= 0:
        ok &= cols >= rows - left
    return ok


def _prepare(q, k, v, softmax_scale):
    """Upcast to float64, check shapes, go to (B, H, N, d) and resolve tau."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-D arrays of layout (B, N, H, d)")
    if k.shape[:3] != v.shape[:3]:  # v's head dim may differ (out then has it)
        raise ValueError(f"k and v differ in (B, N, H_kv): {k.shape} vs {v.shape}")
    b, _, h, d = q.shape
    if (k.shape[0], k.shape[3]) != (b, d) or k.shape[2] == 0 or h % k.shape[2]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on B or d, or k's heads do not divide q's")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    k, v = repeat_kv(k, h), repeat_kv(v, h)
    # (B, N, H, d) -> (B, H, N, d): every head is an independent matrix problem.
    return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale


def repeat_kv(x, heads: int):
    """(B, N, H_kv, d) -> (B, N, heads, d): each k/v head repeated for its group of heads // H_kv
    consecutive query heads (query head h reads k/v head h // group). MHA: x itself."""
    group = heads // x.shape[2]
    return x if group == 1 else np.repeat(x, group, axis=2)


def sum_groups(x, heads_kv: int):
    """(B, N, H, d) -> (B, N, heads_kv, d): the sum over each group of H // heads_kv consecutive
    heads (the gradient of repeat_kv). MHA: x itself."""
    b, n, h, d = x.shape
    return x if h == heads_kv else x.reshape(b, n, heads_kv, h // heads_kv, d).sum(axis=3)


def _dropout_scale(dropout_mask, dropout_p, shape):
    """Z = mask / (1 - p) as float64 of `shape` (B, H, N_q, N_k), or None without dropout."""
    if dropout_mask is None:
        if dropout_p != 0.0:
            raise ValueError("dropout_p > 0 needs an explicit dropout_mask (the oracle does not sample)")
        return None
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    mask = np.asarray(dropout_mask, dtype=bool)
    if mask.shape != shape:
        raise ValueError(f"dropout_mask must have shape {shape}, got {mask.shape}")
    return mask / (1.0 - dropout_p)


def _finite_or_zero(m):
    """Replace -inf running maxima by 0 before subtracting them.

    A row whose scores are all masked has max -inf, and e^{S - m} would be e^{-inf - -inf}
    = NaN. Every score of such a row is itself -inf, so subtracting 0 instead gives the
    correct e^{-inf} = 0 (the same trick the CUDA kernels use).
    """
    return np.where(np.isneginf(m), 0.0, m)


def _normalise(acc, l):
    """acc / l row-wise, with 0 for rows that attended nothing (l == 0). A NaN l (a NaN or +inf
    score in the row) gives a NaN row, as PyTorch's softmax does: `l != 0`, not `l > 0`."""
    attended = l != 0
    return np.where(attended[..., None], acc / np.where(attended, l, 1.0)[..., None], 0.0)


def _lse(m, l):
    """L = m + log(l), -inf for rows that attended nothing (l == 0), NaN where l is NaN."""
    attended = l != 0
    return np.where(attended, m + np.log(np.where(attended, l, 1.0)), -np.inf)


def _softcap(causal, softcap) -> float:
    """The softcap c of a call: `softcap` if given, else a MaskOptions record's, else 0 (none)."""
    if softcap is None:
        softcap = getattr(causal, "softcap", 0.0)
    c = float(softcap or 0.0)
    if not (c >= 0.0 and math.isfinite(c)):
        raise ValueError(f"softcap must be a finite float >= 0 (0: none), got {softcap!r}")
    return c


def alibi_bias(nq: int, nk: int, slopes, batch: int, heads: int, alignment="bottom_right") -> np.ndarray:
    """ALiBi's bias, (B, H, N_q, N_k) float64: -slopes[b, h] |i + offset - j| with query i's
    diagonal key i + offset, offset N_k - N_q (bottom_right, FlashAttention's alibi_slopes) or 0
    (top_left). `slopes`: (H,) (one per head) or (B, H). `alignment` may also be a
    cuflash.mask.MaskOptions (its alignment)."""
    alignment = getattr(alignment, "alignment", alignment)
    slopes = np.asarray(slopes, dtype=np.float64)
    if slopes.shape not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}), got {slopes.shape}")
    slopes = np.broadcast_to(slopes, (batch, heads))
    offset = nk - nq if alignment == "bottom_right" else 0
    dist = np.abs(np.arange(nq)[:, None] + offset - np.arange(nk)[None, :]).astype(np.float64)
    return -slopes[:, :, None, None] * dist


def _scores(qi, kj, scale, allowed, softcap=0.0, bias=None, mods=None):
    """S_ij = tau Q_i K_j^T, or c tanh(tau Q_i K_j^T / c) with softcap c > 0, then a user
    modification `mods` = (score_mod, mask_mod) (see attention_naive), plus `bias` (ALiBi's,
    broadcastable), with disallowed entries set to -inf after it (allowed=None: no mask)."""
    s = scale * (qi @ kj.swapaxes(-1, -2))
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if mods is not None:
        grids = tuple(np.arange(n).reshape([n if i == j else 1 for j in range(4)]) for i, n in enumerate(s.shape))
        if mods[0] is not None:
            s = np.asarray(mods[0](s, *grids), dtype=np.float64)
        if mods[1] is not None:
            s = np.where(np.broadcast_to(mods[1](*grids), s.shape), s, -np.inf)
    if bias is not None:
        s = s + bias
    return s if allowed is None else np.where(allowed, s, -np.inf)


def _out_layout(*xs):
    """(B, H, N, d) -> (B, N, H, d) for every array given."""
    return tuple(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in xs)


# --------------------------------------------------------------------------- forward


def attention_naive(q, k, v, *, causal=False, softmax_scale=None, dropout_mask=None, dropout_p=0.0, window_size=(-1, -1),
                    softcap=None, alibi_slopes=None, score_mod=None, mask_mod=None):
    """Standard attention, materialising the N_q x N_k matrices.

    S = tau Q K^T (c tanh(tau Q K^T / c) with softcap c; then a user modification: S =
    score_mod(S, b, h, q_idx, kv_idx) and -inf where not mask_mod(b, h, q_idx, kv_idx), NumPy
    functions over broadcastable index grids, what a cuflash.ScoreMod's snippets compute per score;
    plus ALiBi's alibi_bias with alibi_slopes; masked entries -inf), P = softmax(S),
    O = (P o Z) V with Z the dropout scale (Z = 1 without dropout), L = log rowsum(e^S).

    Returns ``(out, lse)``: out (B, N_q, H, d) and lse (B, H, N_q), float64.
    """
    q, k, v, scale = _prepare(q, k, v, softmax_scale)
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    z = _dropout_scale(dropout_mask, dropout_p, (b, h, nq, nk))

    bias = None if alibi_slopes is None else alibi_bias(nq, nk, alibi_slopes, b, h, getattr(causal, "alignment",
                                                                                           "bottom_right"))
    s = _scores(q, k, scale, visible(nq, nk, causal, window_size), _softcap(causal, softcap), bias,
                (score_mod, mask_mod) if score_mod is not None or mask_mod is not None else None)
    m = s.max(axis=-1)
    e = np.exp(s - _finite_or_zero(m)[..., None])
    l = e.sum(axis=-1)
    p = _normalise(e, l)  # divides each row of e by its l; rows with l == 0 stay 0
    if z is not None:
        p = p * z
    (out,) = _out_layout(p @ v)
    return out, _lse(m, l)


def attention_sinks(q, k, v, sinks, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=None):
    """Attention with per-head sinks from the definition: each row's softmax runs over its scores
    and one more column holding sinks[h], which has no value (gpt-oss; transformers' s_aux).

    Returns ``(out, lse)`` like attention_naive, lse = log of the row's sum including the sink.
    """
    q, k, v, scale = _prepare(q, k, v, softmax_scale)
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    sinks = np.asarray(sinks, dtype=np.float64)
    if sinks.shape != (h,):
        raise ValueError(f"sinks must have shape ({h},), got {sinks.shape}")
    s = _scores(q, k, scale, visible(nq, nk, causal, window_size), _softcap(causal, softcap))
    s = np.concatenate([s, np.broadcast_to(sinks[None, :, None, None], (b, h, nq, 1))], axis=-1)
    m = s.max(axis=-1)
    e = np.exp(s - m[..., None])
    l = e.sum(axis=-1)
    p = e / l[..., None]
    (out,) = _out_layout(p[..., :nk] @ v)
    return out, m + np.log(l)


def visible_per_batch(nq: int, capacity: int, seqlens, causal=False, window_size=(-1, -1)) -> np.ndarray:
    """(B, 1, N_q, capacity) bool: batch b's query i sees key k iff k < seqlens[b] and the causal /
    window mask allows it with query i at key position seqlens[b] - N_q + i (bottom-right against
    the batch's own length: FlashAttention's KV-cache convention). Written from the definition,
    over the whole capacity, not by slicing."""
    lens = np.asarray(seqlens, dtype=np.int64).reshape(-1, 1, 1)
    if not isinstance(causal, (bool, np.bool_, int)):  # a MaskOptions record
        causal, window_size = causal.causal, causal.window_size
    left, right = window_size
    rows = np.arange(nq)[None, :, None] + lens - nq
    cols = np.arange(capacity)[None, None, :]
    ok = cols < lens
    if causal:
        ok = ok & (cols <= rows)
    if right >= 0:
        ok = ok & (cols <= rows + right)
    if left >= 0:
        ok = ok & (cols >= rows - left)
    return np.broadcast_to(ok, (lens.shape[0], nq, capacity))[:, None]


def attention_kvcache(q, k_cache, v_cache, cache_seqlens, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                      softcap=None):
    """Attention of q (B, N_q, H, d) to the first cache_seqlens[b] keys of each batch's cache
    (B, capacity, H_kv, d), the mask bottom-right aligned to that length (visible_per_batch).
    Keys past a batch's length are never read (they may hold anything, NaN included).
    Returns ``(out, lse)`` as attention_naive: float64, rows that see no key 0 / -inf."""
    lens = np.asarray(cache_seqlens, dtype=np.int64).reshape(-1)
    k_cache, v_cache = np.asarray(k_cache, dtype=np.float64), np.asarray(v_cache, dtype=np.float64)
    cap = k_cache.shape[1]
    if lens.shape[0] != k_cache.shape[0] or (lens < 0).any() or (lens > cap).any():
        raise ValueError(f"cache_seqlens must hold one length in [0, {cap}] per batch, got {lens}")
    used = np.arange(cap)[None, :, None, None] < lens[:, None, None, None]
    k_cache, v_cache = np.where(used, k_cache, 0.0), np.where(used, v_cache, 0.0)  # unread keys: no NaN leaks
    q, k, v, scale = _prepare(q, k_cache, v_cache, softmax_scale)
    nq = q.shape[2]
    s = _scores(q, k, scale, visible_per_batch(nq, cap, lens, causal, window_size), _softcap(causal, softcap))
    m = s.max(axis=-1) if cap else np.full(s.shape[:-1], -np.inf)
    e = np.exp(s - _finite_or_zero(m)[..., None])
    l = e.sum(axis=-1)
    (out,) = _out_layout(_normalise(e, l) @ v)
    return out, _lse(m, l)


def attention_v1_tiled(
    q, k, v, *, causal=False, softmax_scale=None, block_q=64, block_k=64, dropout_mask=None, dropout_p=0.0
):
    """FlashAttention-1 forward, Algorithm 1 (Algorithm 2 with dropout) of Dao et al. 2022.

    O, l, m live in "HBM" arrays initialised to 0, 0, -inf. The OUTER loop runs over K/V
    blocks j, the INNER loop over Q blocks i. Each step loads O_i, l_i, m_i and computes

        S_ij = tau Q_i K_j^T
        m~_ij = rowmax(S_ij),  P~_ij = e^{S_ij - m~_ij},  l~_ij = rowsum(P~_ij)
        m_i^new = max(m_i, m~_ij)
        l_i^new = e^{m_i - m_i^new} l_i + e^{m~_ij - m_i^new} l~_ij
        O_i <- diag(l_i^new)^-1 (diag(l_i) e^{m_i - m_i^new} O_i + e^{m~_ij - m_i^new} (P~_ij o Z_ij) V_j)

    and writes O_i, l_i, m_i back. O_i is therefore re-normalised at every step, the
    extra work FlashAttention-2 removes. The lse returned is m + log(l).
    """
    q, k, v, scale = _prepare(q, k, v, softmax_scale)
    b, h, nq, d = q.shape
    nk = k.shape[2]
    z = _dropout_scale(dropout_mask, dropout_p, (b, h, nq, nk))
    allowed = causal_mask(nq, nk) if causal else None

    o = np.zeros((b, h, nq, v.shape[-1]))  # v's head dim
    l = np.zeros((b, h, nq))
    m = np.full((b, h, nq), -np.inf)

    for j0 in range(0, nk, block_k):
        j1 = min(j0 + block_k, nk)
        kj, vj = k[:, :, j0:j1], v[:, :, j0:j1]
        for i0 in range(0, nq, block_q):
            i1 = min(i0 + block_q, nq)
            qi, oi, li, mi = q[:, :, i0:i1], o[:, :, i0:i1], l[:, :, i0:i1], m[:, :, i0:i1]

            # Algorithm 1 does not skip fully masked blocks: the -inf guards below make
            # such a block a no-op (m~ = -inf, P~ = 0, l~ = 0).
            s = _scores(qi, kj, scale, None if allowed is None else allowed[i0:i1, j0:j1])
            m_blk = s.max(axis=-1)
            p_blk = np.exp(s - _finite_or_zero(m_blk)[..., None])
            l_blk = p_blk.sum(axis=-1)  # l~ is the UNdropped row sum: dropout does not renormalise

            m_new = np.maximum(mi, m_blk)
            m_safe = _finite_or_zero(m_new)
            alpha = np.exp(mi - m_safe)  # rescales the old O_i, l_i
            beta = np.exp(m_blk - m_safe)  # rescales this block's contribution
            l_new = alpha * li + beta * l_blk

            if z is not None:
                p_blk = p_blk * z[:, :, i0:i1, j0:j1]
            acc = (li * alpha)[..., None] * oi + beta[..., None] * (p_blk @ vj)
            o[:, :, i0:i1] = _normalise(acc, l_new)
            l[:, :, i0:i1] = l_new
            m[:, :, i0:i1] = m_new

    (out,) = _out_layout(o)
    return out, _lse(m, l)


def attention_v2_tiled(
    q, k, v, *, causal=False, softmax_scale=None, block_q=64, block_k=64, dropout_mask=None, dropout_p=0.0
):
    """FlashAttention-2 forward, Algorithm 1 of Dao 2023.

    The OUTER loop runs over Q blocks i (one thread block each in the kernel), the INNER
    loop over K/V blocks j, with m_i, l_i and an UNnormalised accumulator O~_i kept on chip:

        S_ij = tau Q_i K_j^T
        m_i^(j) = max(m_i^(j-1), rowmax(S_ij)),   P~_ij = e^{S_ij - m_i^(j)}
        l_i^(j) = e^{m_i^(j-1) - m_i^(j)} l_i^(j-1) + rowsum(P~_ij)
        O~_i^(j) = diag(e^{m_i^(j-1) - m_i^(j)}) O~_i^(j-1) + (P~_ij o Z_ij) V_j

    and only at the end O_i = diag(l_i)^-1 O~_i, L_i = m_i + log(l_i).
    """
    q, k, v, scale = _prepare(q, k, v, softmax_scale)
    b, h, nq, d = q.shape
    nk = k.shape[2]
    z = _dropout_scale(dropout_mask, dropout_p, (b, h, nq, nk))
    allowed = causal_mask(nq, nk) if causal else None

    o = np.zeros((b, h, nq, v.shape[-1]))  # v's head dim
    lse = np.full((b, h, nq), -np.inf)

    for i0 in range(0, nq, block_q):
        i1 = min(i0 + block_q, nq)
        qi = q[:, :, i0:i1]
        acc = np.zeros((b, h, i1 - i0, v.shape[-1]))
        l = np.zeros((b, h, i1 - i0))
        m = np.full((b, h, i1 - i0), -np.inf)

        # Causal: the last row of the block, i1 - 1, sees keys j <= i1 - 1 + N_k - N_q, so
        # K blocks starting beyond that are fully masked and, as in the kernel, never
        # loaded. (When this bound is <= 0 the whole Q block attends nothing: O = 0, L = -inf.)
        k_end = min(nk, i1 + nk - nq) if causal else nk
        for j0 in range(0, k_end, block_k):
            j1 = min(j0 + block_k, nk)
            s = _scores(qi, k[:, :, j0:j1], scale, None if allowed is None else allowed[i0:i1, j0:j1])
            m_new = np.maximum(m, s.max(axis=-1))
            m_safe = _finite_or_zero(m_new)  # rows still fully masked so far
            p = np.exp(s - m_safe[..., None])
            alpha = np.exp(m - m_safe)
            l = alpha * l + p.sum(axis=-1)
            if z is not None:
                p = p * z[:, :, i0:i1, j0:j1]
            acc = alpha[..., None] * acc + p @ v[:, :, j0:j1]
            m = m_new

        o[:, :, i0:i1] = _normalise(acc, l)  # the single division by l
        lse[:, :, i0:i1] = _lse(m, l)

    (out,) = _out_layout(o)
    return out, lse


# --------------------------------------------------------------------------- backward


def _prepare_backward(dout, q, k, v, out, lse, softmax_scale):
    q, k, v, scale = _prepare(q, k, v, softmax_scale)
    do = np.asarray(dout, dtype=np.float64)
    o = np.asarray(out, dtype=np.float64)
    b, h, nq, _ = q.shape
    dv = v.shape[-1]  # out's and dout's head dim (v's)
    if do.shape != (b, nq, h, dv) or o.shape != (b, nq, h, dv):
        raise ValueError(f"dout {do.shape} and out {o.shape} must have q's shape with v's head dim {(b, nq, h, dv)}")
    lse = np.asarray(lse, dtype=np.float64)
    if lse.shape != (b, h, nq):
        raise ValueError(f"lse must have shape (B, H, N_q) = {(b, h, nq)}, got {lse.shape}")
    do, o = do.transpose(0, 2, 1, 3), o.transpose(0, 2, 1, 3)
    # D_i = rowsum(dO_i o O_i) = rowsum(P_i o dP_i): the FA2 preprocessing step.
    dvec = (do * o).sum(axis=-1)
    # Rows that attended nothing have L = -inf and all their scores masked to -inf; using
    # L = +inf there gives P = e^{-inf - inf} = 0 instead of the NaN of -inf - -inf.
    lse_safe = np.where(np.isneginf(lse), np.inf, lse)
    return do, q, k, v, dvec, lse_safe, scale


def attention_backward(
    dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, dropout_mask=None, dropout_p=0.0, window_size=(-1, -1),
    softcap=None,
):
    """Gradients of O = attention(Q, K, V) for the loss whose output gradient is dO.

    FlashAttention-2 backward formulas, with P recomputed from the saved L instead of stored:

        P  = e^{tau Q K^T - L}        (0 where masked or where L = -inf)
        dV = (P o Z)^T dO
        dP = (dO V^T) o Z
        D  = rowsum(dO o O)
        dS = P o (dP - D)            (o (1 - T^2), T = tanh(tau Q K^T / c), with softcap c)
        dQ = tau dS K,   dK = tau dS^T Q

    with Z = mask / (1 - p) under dropout (Z = 1 otherwise). ``out`` and ``lse`` are the
    forward's outputs. Returns ``(dq, dk, dv)`` in the layout of q, k, v, float64 (GQA: dK, dV
    summed over each k/v head's group of query heads).
    """
    heads_kv = np.shape(k)[2]
    do, q, k, v, dvec, lse_safe, scale = _prepare_backward(dout, q, k, v, out, lse, softmax_scale)
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    z = _dropout_scale(dropout_mask, dropout_p, (b, h, nq, nk))

    c = _softcap(causal, softcap)
    s = _scores(q, k, scale, visible(nq, nk, causal, window_size), c)
    p = np.exp(s - lse_safe[..., None])
    pz = p if z is None else p * z
    dp = do @ v.swapaxes(-1, -2)
    if z is not None:
        dp = dp * z
    ds = p * (dp - dvec[..., None])
    if c:  # the chain rule through c tanh(x / c): 1 - tanh^2(x / c), x = tau Q K^T (finite everywhere)
        ds = ds * (1.0 - np.tanh(scale * (q @ k.swapaxes(-1, -2)) / c) ** 2)

    dv = pz.swapaxes(-1, -2) @ do
    dq = scale * (ds @ k)
    dk = scale * (ds.swapaxes(-1, -2) @ q)
    dq, dk, dv = _out_layout(dq, dk, dv)
    return dq, sum_groups(dk, heads_kv), sum_groups(dv, heads_kv)


def attention_backward_tiled(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, block_q=64, block_k=64):
    """FlashAttention-2 backward, Algorithm 2 of Dao 2023 (no dropout).

    The OUTER loop runs over K/V blocks j, keeping dK_j and dV_j "on chip"; the INNER loop
    over Q blocks i recomputes P_ij = e^{S_ij - L_i} and accumulates

        dV_j += P_ij^T dO_i,   dP_ij = dO_i V_j^T,   dS_ij = P_ij o (dP_ij - D_i)
        dK_j += tau dS_ij^T Q_i,   dQ_i += tau dS_ij K_j

    dQ is shared by all K/V blocks, so it lives in a float64 buffer in "HBM" (the kernel
    accumulates it there with atomic adds in float32).
    """
    heads_kv = np.shape(k)[2]
    do, q, k, v, dvec, lse_safe, scale = _prepare_backward(dout, q, k, v, out, lse, softmax_scale)
    nq, nk = q.shape[2], k.shape[2]
    allowed = causal_mask(nq, nk) if causal else None

    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)

    for j0 in range(0, nk, block_k):
        j1 = min(j0 + block_k, nk)
        kj, vj = k[:, :, j0:j1], v[:, :, j0:j1]
        dkj = np.zeros_like(kj)
        dvj = np.zeros_like(vj)

        # Causal: key j0 is first visible to row j0 - (N_k - N_q); Q blocks that end before
        # that row are fully masked for this K block and, as in the kernel, skipped.
        i_first = max(0, j0 - (nk - nq)) if causal else 0
        for i0 in range(i_first // block_q * block_q, nq, block_q):
            i1 = min(i0 + block_q, nq)
            qi, doi = q[:, :, i0:i1], do[:, :, i0:i1]
            s = _scores(qi, kj, scale, None if allowed is None else allowed[i0:i1, j0:j1])
            p = np.exp(s - lse_safe[:, :, i0:i1, None])
            dvj += p.swapaxes(-1, -2) @ doi
            dp = doi @ vj.swapaxes(-1, -2)
            ds = p * (dp - dvec[:, :, i0:i1, None])
            dkj += scale * (ds.swapaxes(-1, -2) @ qi)
            dq[:, :, i0:i1] += scale * (ds @ kj)

        dk[:, :, j0:j1] = dkj
        dv[:, :, j0:j1] = dvj

    dq, dk, dv = _out_layout(dq, dk, dv)
    return dq, sum_groups(dk, heads_kv), sum_groups(dv, heads_kv)


def rotary(x, cos, sin, positions, *, interleaved: bool = False):
    """Rotary position embedding of x (B, T, H, d) at `positions` (B, T) (int), FlashAttention's:
    cos, sin are (seqlen_ro, rotary_dim / 2) tables; the first rotary_dim features are rotated in
    pairs (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos), the pairs being (i, i + rotary_dim / 2)
    (GPT-NeoX, interleaved=False) or (2i, 2i + 1) (GPT-J, interleaved=True); the rest are kept.
    Float64."""
    x = np.asarray(x, dtype=np.float64)
    cos, sin = np.asarray(cos, dtype=np.float64), np.asarray(sin, dtype=np.float64)
    half = cos.shape[1]
    c = cos[np.asarray(positions)][:, :, None, :]  # (B, T, 1, half)
    s = sin[np.asarray(positions)][:, :, None, :]
    out = x.copy()
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]
        out[..., :half], out[..., half:2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return out
