"""cuflash: exact FlashAttention for CuPy, compiled at run time by NVRTC and tuned per GPU.

    out = cuflash.attention(q, k, v, causal=True)          # q, k, v: (batch, seqlen, heads, head_dim)
    out, lse = cuflash.attention(q, k, v, return_lse=True)  # lse: float32 (batch, heads, seqlen_q)

CuPy is imported lazily, so `cuflash.reference` and the CLI's CPU fallback work without a GPU.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["attention", "__version__"]


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False):
    """Exact softmax attention, FlashAttention-2 algorithm, never materialising the N x N matrix.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads, head_dim); CuPy arrays of
    float16 or bfloat16 (ml_dtypes.bfloat16) on one device, contiguous in the last dimension (other
    strides are free, e.g. slices of a packed qkv array; used without copies). head_dim 64 or 128.
    causal: mask aligned to the bottom-right when seqlen_q != seqlen_k (FlashAttention >= 2.1);
        rows that see no key give 0 (and lse -inf).
    softmax_scale: defaults to 1/sqrt(head_dim).
    return_lse: also return the natural-log log-sum-exp per row, float32 (batch, heads, seqlen_q).

    Runs on CuPy's current stream. Raises TypeError/ValueError before any launch on bad input.
    """
    from ._forward import forward

    out, lse = forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return (out, lse) if return_lse else out
