"""Rotary position embedding for the KV-cache path (cuflash/kvcache.py), FlashAttention's
`flash_attn_with_kvcache` convention, on CuPy arrays.

cos, sin: (seqlen_ro, rotary_dim / 2) tables; the first rotary_dim features of each head are
rotated in pairs (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos), the pairs (2i, 2i + 1) when
interleaved (GPT-J) and (i, i + rotary_dim / 2) otherwise (GPT-NeoX); the other features are kept.
The arithmetic is float32 (as FlashAttention's), rounded once to the array's dtype (round to
nearest even). The NumPy reference is cuflash.reference.rotary.

Built from CuPy array operations on 16-bit bit patterns (bfloat16 is widened by a shift and
narrowed with the round-to-nearest-even carry), so it needs nothing of CuPy's bfloat16 support.
A few small kernels per call: the decode-time tensors (q, k_new) are small.
"""
from __future__ import annotations

import numpy as np


def check_tables(cos, sin, head_dim: int, device: int):
    """(cos, sin) as float32 CuPy arrays (seqlen_ro, rotary_dim / 2), checked; ValueError / TypeError
    naming the argument."""
    import cupy

    for x, name in ((cos, "rotary_cos"), (sin, "rotary_sin")):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a CuPy array (or a CUDA tensor of another framework), got "
                            f"{type(x).__module__}.{type(x).__qualname__}")
        if x.device.id != device:
            raise ValueError(f"{name} is on device {x.device.id}, q on {device}")
    if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[1] == 0:
        raise ValueError(f"rotary_cos and rotary_sin must have one shape (seqlen_ro, rotary_dim / 2), got {cos.shape} "
                         f"and {sin.shape}")
    if 2 * cos.shape[1] > head_dim:
        raise ValueError(f"rotary_dim = 2 x {cos.shape[1]} exceeds head_dim {head_dim}")
    if cos.dtype.name not in ("float16", "bfloat16", "float32"):
        raise TypeError(f"rotary_cos has dtype {cos.dtype}; float16, bfloat16 or float32 expected")
    return _to_f32(cos), _to_f32(sin)


def _to_f32(x):
    import cupy

    x = cupy.ascontiguousarray(x)
    if x.dtype.name == "bfloat16":  # the top half of a float32
        return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return x.astype(cupy.float32)


def _from_f32(f, dtype):
    import cupy

    if np.dtype(dtype).name == "bfloat16":  # round to nearest even on the dropped half
        b = cupy.ascontiguousarray(f).view(cupy.uint32)
        b = (b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16
        return b.astype(cupy.uint16).view(dtype)
    return f.astype(dtype)


def apply(x, cos32, sin32, positions, interleaved: bool):
    """x (B, T, H, d) rotated at positions (B, T) (int, CuPy; clipped to the tables' rows): a new
    contiguous array of x's dtype."""
    import cupy

    half = cos32.shape[1]
    pos = cupy.clip(positions, 0, cos32.shape[0] - 1)
    c, s = cos32[pos][:, :, None, :], sin32[pos][:, :, None, :]  # (B, T, 1, half)
    xf = _to_f32(x)
    if interleaved:
        x1, x2 = xf[..., 0:2 * half:2], xf[..., 1:2 * half:2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:2 * half]
    r1, r2 = x1 * c - x2 * s, x1 * s + x2 * c
    if interleaved:
        xf[..., 0:2 * half:2], xf[..., 1:2 * half:2] = r1, r2
    else:
        xf[..., :half], xf[..., half:2 * half] = r1, r2
    return _from_f32(xf, x.dtype)


def positions(lengths, n: int, per_token: bool):
    """(B, n) positions: lengths[b] + t (per_token), else lengths[b] for every t (FlashAttention's
    queries without a causal mask or window all sit at the cache's length)."""
    import cupy

    lens = cupy.asarray(lengths).astype(cupy.int64)[:, None]
    return lens + (cupy.arange(n, dtype=cupy.int64)[None] if per_token else 0)


def host_positions_problem(lengths: np.ndarray, n: int, seqlen_ro: int) -> str | None:
    """Why host lengths reach past the tables (the largest position is lengths + n - 1), or None."""
    if n and lengths.size and int(lengths.max()) + n - 1 >= seqlen_ro:
        b = int(np.argmax(lengths))
        return (f"rotary tables have {seqlen_ro} positions but batch {b} needs position "
                f"{int(lengths[b]) + n - 1} (cache_seqlens {int(lengths[b])} + {n} new tokens - 1)")
    return None

