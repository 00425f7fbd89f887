"""seqused_q / seqused_k for variable-length batches (FlashAttention 3's): sequence b keeps its
packed rows [cu_seqlens[b], cu_seqlens[b + 1]) but uses only the first seqused_q[b] of its queries
and seqused_k[b] of its keys; the rest may hold any finite values (a fixed packing reused over
steps of varying lengths, as CUDA graphs need). Not NaN or Inf: the Hopper kernels load whole tiles
of rows, and a row the mask gives weight 0 still multiplies (0 x NaN = NaN), as in FlashAttention
(its issue 1990); zero such rows first (e.g. buffers from torch.empty). The mask aligns to the used
lengths.

No kernel of its own, and nothing copied but the offsets: each sequence b becomes three of the
kernels' sequences over the same packed rows (`expand`),

    3b      its used queries with its used keys       (the attention)
    3b + 1  its unused queries with no key            (out 0, lse -inf; dq 0)
    3b + 2  no query with its unused keys             (dk, dv 0)

so offsets of 3 batch + 1 entries describe it: no unused query attends and no unused key is
attended. A length
past its sequence's rows is clipped to them (the device values are not read on the host). What
the three-way split shows: dropout's Philox mask of sequence b is the one of sequence index 3b
(attn/dropout.cuh counts (batch, head) pairs), and per-batch ALiBi slopes are repeated to
(3 batch, heads) (a copy of the slopes only).
"""
from __future__ import annotations

import numpy as np

from . import launch, staging

_EXPAND = None


def _expand_kernel():
    global _EXPAND
    if _EXPAND is None:
        import cupy

        _EXPAND = cupy.ElementwiseKernel(
            "raw int32 cu_q, raw int32 cu_k, raw int32 used_q, raw int32 used_k, int32 batch, int32 has_q, "
            "int32 has_k",
            "raw int32 out_q, raw int32 out_k",
            """
            if (i == batch) {
                out_q[3 * batch] = cu_q[batch];
                out_k[3 * batch] = cu_k[batch];
            } else {
                const int q0 = cu_q[i], q1 = cu_q[i + 1], k0 = cu_k[i], k1 = cu_k[i + 1];
                const int uq = has_q ? min(max(used_q[i], 0), max(q1 - q0, 0)) : max(q1 - q0, 0);
                const int uk = has_k ? min(max(used_k[i], 0), max(k1 - k0, 0)) : max(k1 - k0, 0);
                out_q[3 * i] = q0;
                out_q[3 * i + 1] = q0 + uq;
                out_q[3 * i + 2] = q1;
                out_k[3 * i] = k0;
                out_k[3 * i + 1] = k0 + uk;
                out_k[3 * i + 2] = k0 + uk;
            }
            """,
            "cuflash_seqused_offsets")
    return _EXPAND


def split_offsets(cu_q, cu_k, used_q=None, used_k=None) -> tuple[np.ndarray, np.ndarray]:
    """The three-way split's offsets (3 batch + 1,) int32 from host offsets and lengths (None: all rows):
    the rule expand's kernel applies on the device, in NumPy (the tests' oracle)."""
    cu_q, cu_k = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_k, dtype=np.int64)
    len_q, len_k = np.maximum(np.diff(cu_q), 0), np.maximum(np.diff(cu_k), 0)
    uq = len_q if used_q is None else np.clip(np.asarray(used_q, dtype=np.int64), 0, len_q)
    uk = len_k if used_k is None else np.clip(np.asarray(used_k, dtype=np.int64), 0, len_k)
    b = len(len_q)
    out_q, out_k = np.empty(3 * b + 1, dtype=np.int32), np.empty(3 * b + 1, dtype=np.int32)
    for out, cu, bounds in ((out_q, cu_q, (cu_q[:-1] + uq, cu_q[1:])), (out_k, cu_k, (cu_k[:-1] + uk,) * 2)):
        out[0:3 * b:3], out[1:3 * b:3], out[2:3 * b:3], out[-1] = cu[:-1], *bounds, cu[-1]
    return out_q, out_k


def host_lengths(seqused, name: str, batch: int) -> np.ndarray:
    """Host lengths (integers, one per sequence, none negative) as int32, checked."""
    arr = np.asarray(seqused)
    if arr.dtype.kind not in "iu" or arr.shape != (batch,):
        raise ValueError(f"{name} must be integers of shape (batch={batch},), got {arr.dtype} {arr.shape}")
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        raise ValueError(f"{name}[{int(bad[0])}] = {int(arr[bad[0]])}: lengths must be >= 0")
    if arr.size and int(arr.max()) >= 2**31:
        raise ValueError(f"{name} must be below 2^31, got {int(arr.max())}")
    return arr.astype(np.int32)


def device_lengths(seqused, name: str, batch: int, device: int):
    """A CuPy array of lengths as int32, checked for shape, dtype and device only (reading the values
    would synchronise); host lengths (host_lengths) copied there asynchronously."""
    import cupy

    if not isinstance(seqused, cupy.ndarray):
        return staging.upload(host_lengths(seqused, name, batch), name)
    if seqused.dtype.kind not in "iu" or seqused.shape != (batch,):
        raise ValueError(f"{name} must be an integer array of shape (batch={batch},), got {seqused.dtype} "
                         f"{seqused.shape}")
    if seqused.device.id != device:
        raise ValueError(f"{name} is on device {seqused.device.id}, q on {device}")
    with launch.graph_temporaries():  # (an int64 array's int32 copy lives only as long as the call)
        return cupy.ascontiguousarray(seqused.astype(cupy.int32, copy=False))


def expand(cu_q, cu_k, used_q, used_k, batch: int):
    """The offsets (3 batch + 1,) int32 of the three-way split (module docstring) of the contiguous
    int32 offsets cu_q, cu_k (batch + 1,), for the int32 lengths used_q / used_k (device_lengths'; None:
    all rows), on the device."""
    import cupy

    with launch.graph_temporaries():  # the offsets live only as long as the call
        out_q = cupy.empty(3 * batch + 1, dtype=cupy.int32)
        out_k = cupy.empty(3 * batch + 1, dtype=cupy.int32)
    uq, uk = (cu_q if u is None else u for u in (used_q, used_k))  # (a stand-in, not read, where none is given)
    _expand_kernel()(cu_q, cu_k, uq, uk, np.int32(batch), np.int32(used_q is not None),
                     np.int32(used_k is not None), out_q, out_k, size=batch + 1)
    return out_q, out_k


def repeat_slopes(alibi_slopes):
    """Per-batch ALiBi slopes (batch, heads) repeated to (3 batch, heads) (each sequence's three parts
    take its slopes); per-head ones (heads,) as they are."""
    import cupy

    if alibi_slopes is None or alibi_slopes.ndim == 1:
        return alibi_slopes
    with launch.graph_temporaries():
        return cupy.repeat(alibi_slopes, 3, axis=0)
