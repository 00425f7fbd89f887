"""Argument checks for the public entry points, done before any kernel launch.

Checks run on `ArrayInfo` records (shape, dtype, strides, pointer, device), not on arrays, so that
every rule is testable on a machine without a GPU. Messages name the argument, what it got and what
is expected, in the style of FlashAttention's and PyTorch's own checks.
"""
from __future__ import annotations

import dataclasses
import math

from .features import SUPPORTED_DTYPES, Features
from .tiles import SUPPORTED_HEAD_DIMS

# cp.async moves 16 bytes at a time: base pointers and row strides must be 16-byte aligned.
ALIGN_BYTES = 16


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    shape: tuple
    dtype: str  # numpy-style name, e.g. "bfloat16"
    itemsize: int
    strides: tuple  # in bytes, as NumPy/CuPy report them
    ptr: int
    device: int  # CUDA device ordinal


@dataclasses.dataclass(frozen=True)
class FwdProblem:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    head_dim: int
    dtype: str
    device: int
    causal: bool
    softmax_scale: float
    dropout: bool = False

    @property
    def features(self) -> Features:
        return Features(self.dtype, self.head_dim, self.dropout)


def describe(x, name: str) -> ArrayInfo:
    """ArrayInfo for a CuPy array; TypeError naming `name` for anything else."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - cupy is a hard requirement at run time
        raise ImportError("cuflash needs CuPy: pip install 'cuflash[cuda13]' (or [cuda12])") from e
    if not isinstance(x, cupy.ndarray):
        kind = f"{type(x).__module__}.{type(x).__name__}"
        raise TypeError(f"{name} must be a CuPy array on a CUDA device, got {kind}")
    return ArrayInfo(tuple(x.shape), x.dtype.name, x.dtype.itemsize, tuple(x.strides), x.data.ptr, x.device.id)


def check_layout(a: ArrayInfo, name: str) -> None:
    if len(a.shape) != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {a.shape}")
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {a.dtype}; supported dtypes are float16 and bfloat16")
    if a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (head_dim), got strides {a.strides} bytes; "
            f"call .copy() or ascontiguousarray first")
    if a.ptr % ALIGN_BYTES:
        raise ValueError(f"{name}'s data pointer is not {ALIGN_BYTES}-byte aligned (offset view?); copy it first")
    for dim, s in zip(("batch", "seqlen", "heads"), a.strides[:3]):
        if s % ALIGN_BYTES:
            raise ValueError(
                f"{name}'s {dim} stride ({s} bytes) is not a multiple of {ALIGN_BYTES} bytes; copy it first")


def check_forward(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, causal, softmax_scale, dropout: bool = False) -> FwdProblem:
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        check_layout(a, name)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got devices {q.device}, {k.device}, {v.device}")
    b, nq, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    bk, nk, hk, dk = k.shape
    if bk != b:
        raise ValueError(f"batch size differs: q has {b}, k and v have {bk}")
    if hk != h:
        raise ValueError(f"number of heads differs: q has {h}, k and v have {hk}")
    if dk != d:
        raise ValueError(f"head_dim differs: q has {d}, k and v have {dk}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {d} is not supported; supported head dims: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    if b < 1:
        raise ValueError(f"batch size must be >= 1, got {b}")
    if h < 1:
        raise ValueError(f"number of heads must be >= 1, got {h}")
    if nq < 1:
        raise ValueError(f"seqlen of q must be >= 1, got {nq}")
    if nk < 1:
        raise ValueError(f"seqlen of k and v must be >= 1, got {nk}")
    return FwdProblem(b, nq, nk, h, d, q.dtype, q.device, check_flag(causal, "causal"),
                      check_softmax_scale(softmax_scale, d), dropout)


def check_flag(value, name: str) -> bool:
    """A bool option (0 and 1 are accepted as bools, as in check_forward's `causal`)."""
    if not isinstance(value, (bool, int)) or value not in (0, 1, True, False):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The scale to use: 1/sqrt(head_dim) for None, else a positive finite float."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise TypeError(f"softmax_scale must be a positive finite float or None, got {softmax_scale!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None, got {softmax_scale!r}")
    return scale


def check_algorithm(algorithm) -> str:
    if algorithm != "v2" and algorithm != "v1":
        raise ValueError(f"algorithm must be 'v1' or 'v2', got {algorithm!r}")
    return algorithm


LSE_DTYPE = "float32"


def check_backward(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, lse: ArrayInfo,
                   causal, softmax_scale, dropout: bool = False) -> FwdProblem:
    """Checks for the backward's arguments; returns the problem (as the forward's checks do).

    q, k, v, causal and softmax_scale follow check_forward. `out` (the forward's output) and `dout`
    (the gradient of the loss with respect to it) must have q's shape, dtype and device, and the
    layout rules of q (contiguous last dimension, 16-byte aligned pointer and strides). `lse` is the
    forward's float32 (batch, heads, seqlen_q) log-sum-exp, C-contiguous, on q's device.
    """
    p = check_forward(q, k, v, causal, softmax_scale, dropout)
    for a, name in ((out, "out"), (dout, "dout")):
        if a.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {a.dtype}")
        if a.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {q.shape}, got shape {a.shape}")
        check_layout(a, name)
        if a.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got device {a.device}")
    want = (p.batch, p.heads, p.seqlen_q)
    if lse.dtype != LSE_DTYPE:
        raise TypeError(f"lse must be float32 (the forward's log-sum-exp), got dtype {lse.dtype}")
    if tuple(lse.shape) != want:
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {want}, got shape {lse.shape}")
    contiguous = (p.heads * p.seqlen_q * lse.itemsize, p.seqlen_q * lse.itemsize, lse.itemsize)
    if any(n > 1 and s != c for n, s, c in zip(lse.shape, lse.strides, contiguous)):
        raise ValueError(f"lse must be C-contiguous (strides {contiguous} bytes), got strides {lse.strides}; "
                         f"pass the lse the forward returned, or a contiguous copy of it")
    if lse.ptr % lse.itemsize:
        raise ValueError(f"lse's data pointer is not {lse.itemsize}-byte aligned; copy it first")
    if lse.device != q.device:
        raise ValueError(f"lse must be on q's device {q.device}, got device {lse.device}")
    return p
