"""The dropout mask of cuflash's fused-dropout kernels, reproduced in NumPy (CPU, no CuPy import).

The kernels never store the dropout mask: the forward and the backward regenerate it from
(seed, position) with a counter-based generator, Philox4x32-10. This module computes the same
mask bit for bit, so that the float64 oracle (`cuflash.reference`, which takes an explicit
``dropout_mask``) can check the kernels, and it holds the argument checks and constants the
entry points share.

Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
SC 2011; the Random123 library):

    M0 = 0xD2511F53, M1 = 0xCD9E8D57        (round multipliers)
    W0 = 0x9E3779B9, W1 = 0xBB67AE85        (Weyl key increments)
    one round, counter c = (c0, c1, c2, c3), key k = (k0, k1):
        hi0, lo0 = mulhilo(M0, c0)          (the 64-bit product's high and low 32 bits)
        hi1, lo1 = mulhilo(M1, c2)
        c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    ten rounds; before rounds 2..10 the key is bumped: k0 += W0, k1 += W1 (mod 2^32).

    Known answers (counter[4] key[2] -> out[4], Random123's kat_vectors):
        0 0 0 0 / 0 0                  -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8
        ffffffff x4 / ffffffff x2      -> 408f276d 41c83b0e a20bc7c6 6d5451fd
        243f6a88 85a308d3 13198a2e 03707344 / a4093822 299f31d0
                                       -> d16cfe09 94fdcceb 5001e420 24126ea1

The dropout mask, for q of shape (batch, seqlen_q, heads, d) and k of (batch, seqlen_k, heads, d):

    seed: a Python int in [0, 2^64);  key = (seed & 0xffffffff, seed >> 32).
    T = min(65535, round(p * 65536)) for dropout_p = p in [0, 1) (Python's round: ties to even).
    Element (b, h, i, j) -- i the query row, j the key column, bh = b * heads + h -- has a 16-bit
    uniform value u; it is KEPT iff u >= T, and kept elements are scaled by 65536 / (65536 - T)
    (unbiased for the quantised probability T / 65536; T = 0 drops nothing). u is found by:

        R = i // 16, gp = i % 8, hh = (i % 16) // 8
        C = j // 16, jj = j % 16, s = jj // 8, tp = (jj % 8) // 2, e = jj % 2
        out = philox4x32_10(counter=(C*4 + tp, R*8 + gp, bh, 0), key)
        idx = hh*4 + s*2 + e
        u = (out[idx // 2] >> (16 * (idx % 2))) & 0xffff

    One Philox call thus gives the 8 values one thread of an m16n8k16 MMA holds for a 16 x 16
    block of S: rows {i, i+8} x keys {j, j+1, j+8, j+9} (i = 16R + gp, j = 16C + 2tp).

    The mask depends only on (seed, bh, i, j): not on causal masking, seqlen, tile sizes or the
    algorithm (v1/v2, forward/backward). Elements the causal mask or padding removes are drawn
    like any other; they never matter because their P is 0.

Everything here is vectorised uint64 arithmetic (products of two 32-bit numbers fit in 64 bits);
`dropout_keep_mask` works in chunks of rows so its temporaries stay a few MB whatever the shape.
"""
from __future__ import annotations

import numbers

import numpy as np

__all__ = [
    "philox4x32_10",
    "dropout_threshold",
    "dropout_scale",
    "dropout_uniforms",
    "dropout_keep_mask",
    "check_dropout",
    "seed_key",
    "quantised_p",
    "M0",
    "M1",
    "W0",
    "W1",
    "SEED_LIMIT",
]

M0 = 0xD2511F53
M1 = 0xCD9E8D57
W0 = 0x9E3779B9
W1 = 0xBB67AE85
ROUNDS = 10
SEED_LIMIT = 1 << 64  # seeds are ints in [0, SEED_LIMIT)

_U32 = 0xFFFFFFFF
_M0, _M1 = np.uint64(M0), np.uint64(M1)
_MASK = np.uint64(_U32)
_SHIFT = np.uint64(32)
# Philox calls per chunk in dropout_keep_mask: ~8 uint64 temporaries of this many elements (a few
# MB, cache-friendly) while keeping NumPy's per-call overhead negligible.
_CHUNK_CALLS = 1 << 14


# --------------------------------------------------------------------------- Philox4x32-10


def _round_keys(k0, k1):
    """The ten (k0, k1) pairs of the rounds (scalars or arrays, uint64 holding 32-bit values)."""
    keys = [(k0, k1)]
    w0, w1 = np.uint64(W0), np.uint64(W1)
    for _ in range(ROUNDS - 1):
        k0 = (k0 + w0) & _MASK
        k1 = (k1 + w1) & _MASK
        keys.append((k0, k1))
    return keys


def _rounds(c0, c1, c2, c3, keys):
    """Ten Philox rounds on uint64 arrays holding 32-bit values (broadcastable); returns 4 arrays."""
    for k0, k1 in keys:
        p0 = c0 * _M0
        p1 = c2 * _M1
        n0 = (p1 >> _SHIFT) ^ c1
        n0 ^= k0
        n2 = (p0 >> _SHIFT) ^ c3
        n2 ^= k1
        c0, c1, c2, c3 = n0, p1 & _MASK, n2, p0 & _MASK
    return c0, c1, c2, c3


def _as_u32_array(x, name, last):
    a = np.asarray(x)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an array of unsigned 32-bit integers, got dtype {a.dtype}")
    if a.ndim < 1 or a.shape[-1] != last:
        raise ValueError(f"{name} must have shape (..., {last}), got shape {a.shape}")
    if a.dtype != np.uint32 and a.size and (int(a.min()) < 0 or int(a.max()) > _U32):
        raise ValueError(f"{name} has values outside [0, 2^32)")
    return a.astype(np.uint64)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10 of each counter: counter (..., 4) and key (..., 2) uint32, broadcast -> (..., 4) uint32.

    A key of shape (2,) applies to every counter. Integer arrays of other dtypes are accepted when
    their values lie in [0, 2^32).
    """
    c = _as_u32_array(counter, "counter", 4)
    k = _as_u32_array(key, "key", 2)
    out = _rounds(c[..., 0], c[..., 1], c[..., 2], c[..., 3], _round_keys(k[..., 0], k[..., 1]))
    shape = np.broadcast_shapes(c.shape[:-1], k.shape[:-1])
    return np.stack([np.broadcast_to(w, shape) for w in out], axis=-1).astype(np.uint32)


# --------------------------------------------------------------------------- dropout parameters


def seed_key(seed: int) -> tuple[int, int]:
    """The Philox key (k0, k1) = (low, high) 32-bit halves of a seed in [0, 2^64)."""
    seed = _check_seed(seed)
    return seed & _U32, seed >> 32


def dropout_threshold(p) -> int:
    """T = min(65535, round(p * 65536)): an element is dropped iff its 16-bit uniform is < T."""
    p = _check_p(p)
    return min(65535, round(p * 65536))


def dropout_scale(p) -> float:
    """65536 / (65536 - T): the factor kept elements are multiplied by (1 for p = 0)."""
    return 65536.0 / (65536 - dropout_threshold(p))


def _check_p(dropout_p) -> float:
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not (0.0 <= p < 1.0):  # NaN fails too
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return p


def _check_seed(seed) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int in [0, 2**64), got {seed!r}")
    s = int(seed)
    if not 0 <= s < SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return s


def check_dropout(dropout_p, seed, *, require_seed: bool = True) -> tuple[float, int | None]:
    """Check the dropout arguments of a public entry point; returns (dropout_p as float, seed as int or None).

    dropout_p: a real number in [0, 1) (TypeError for non-numbers and bools, ValueError outside
    the range or NaN). seed: None or an int in [0, 2**64); required (ValueError) when dropout_p > 0
    and `require_seed` (the torch path draws a missing seed itself and passes require_seed=False).
    A seed given with dropout_p == 0 is checked and returned, though unused.
    """
    p = _check_p(dropout_p)
    if seed is None:
        if p > 0.0 and require_seed:
            raise ValueError(
                f"seed is required when dropout_p > 0 (got dropout_p={p!r}, seed=None): pass an int in "
                f"[0, 2**64), and pass the same seed (and dropout_p) to attention_backward so that it "
                f"regenerates the forward's dropout mask")
        return p, None
    return p, _check_seed(seed)


# --------------------------------------------------------------------------- the mask


def _check_dims(**dims) -> None:
    for name, n in dims.items():
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {n!r}")
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")


def _fill(seed, batch, heads, seqlen_q, seqlen_k, out, threshold):
    """Write the 16-bit uniforms (threshold None) or the keep mask u >= threshold into `out`."""
    k0, k1 = seed_key(seed)
    keys = _round_keys(np.uint64(k0), np.uint64(k1))
    bhs = batch * heads
    n_r, n_c = -(-seqlen_q // 16), -(-seqlen_k // 16)  # 16 x 16 blocks of S
    if bhs == 0 or n_r == 0 or n_c == 0:
        return out
    flat = out.reshape(bhs, seqlen_q, seqlen_k)
    per_r = 32 * n_c  # Philox calls per 16-row block (8 gp x n_c C x 4 tp)
    rows = max(1, min(n_r, _CHUNK_CALLS // per_r))  # 16-row blocks per chunk
    g_bh = max(1, _CHUNK_CALLS // (per_r * n_r)) if rows == n_r else 1  # (b, h) pairs per chunk

    # Counter lanes: c0 = 4C + tp (keys), c1 = 8R + gp (rows), c2 = bh, c3 = 0. Axes of a chunk:
    # (bh, R, gp, C, tp); the first round broadcasts them, later rounds work on the full chunk.
    c0 = (np.arange(n_c, dtype=np.uint64)[:, None] * np.uint64(4) + np.arange(4, dtype=np.uint64)).reshape(
        1, 1, 1, n_c, 4)
    gp = np.arange(8, dtype=np.uint64)[:, None, None]
    zero = np.uint64(0)
    for bh0 in range(0, bhs, g_bh):
        bh1 = min(bhs, bh0 + g_bh)
        c2 = np.arange(bh0, bh1, dtype=np.uint64).reshape(-1, 1, 1, 1, 1)
        for r0 in range(0, n_r, rows):
            r1 = min(n_r, r0 + rows)
            c1 = (np.arange(r0, r1, dtype=np.uint64)[:, None, None, None] * np.uint64(8) + gp)[None]
            words = _rounds(c0, c1, c2, c3=zero, keys=keys)
            shape = (bh1 - bh0, r1 - r0, 8, n_c, 4)
            w32 = np.empty(shape + (4,), dtype="<u4")
            for n, w in enumerate(words):
                w32[..., n] = w
            # Little-endian uint16 halves: word n = hh*2 + s, half = e, i.e. idx = 2n + half.
            u = w32.view("<u2").reshape(shape + (2, 2, 2))  # (bh, R, gp, C, tp, hh, s, e)
            if threshold is not None:
                u = u >= threshold
            # -> (bh, R, hh, gp, C, s, tp, e): row 16R + 8hh + gp, key 16C + 8s + 2tp + e.
            blk = u.transpose(0, 1, 5, 2, 3, 6, 4, 7).reshape(bh1 - bh0, (r1 - r0) * 16, n_c * 16)
            i0, i1 = r0 * 16, min(seqlen_q, r1 * 16)
            flat[bh0:bh1, i0:i1] = blk[:, : i1 - i0, :seqlen_k]
    return out


def dropout_uniforms(seed, batch, heads, seqlen_q, seqlen_k) -> np.ndarray:
    """The 16-bit uniform value u of every element: uint16 (batch, heads, seqlen_q, seqlen_k)."""
    _check_dims(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    out = np.empty((batch, heads, seqlen_q, seqlen_k), dtype=np.uint16)
    return _fill(seed, batch, heads, seqlen_q, seqlen_k, out, None)


def dropout_keep_mask(seed, batch, heads, seqlen_q, seqlen_k, dropout_p) -> np.ndarray:
    """The kernels' keep mask: bool (batch, heads, seqlen_q, seqlen_k), True = kept (u >= T).

    Pass it to `cuflash.reference` functions with ``dropout_p = dropout_threshold(p) / 65536`` (the
    quantised probability, whose 1 / (1 - p) is exactly `dropout_scale(p)`).
    """
    p, seed = check_dropout(dropout_p, seed)
    if seed is None:  # p == 0: nothing is dropped, whatever the seed
        _check_dims(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        return np.ones((batch, heads, seqlen_q, seqlen_k), dtype=bool)
    _check_dims(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    out = np.empty((batch, heads, seqlen_q, seqlen_k), dtype=bool)
    return _fill(seed, batch, heads, seqlen_q, seqlen_k, out, np.uint16(dropout_threshold(p)))


def quantised_p(dropout_p) -> float:
    """T / 65536: the dropout probability the kernels really apply (what the oracle should be given)."""
    return dropout_threshold(dropout_p) / 65536
