"""cuflash: exact FlashAttention for CuPy, compiled at run time by NVRTC and tuned per GPU.

    out = cuflash.attention(q, k, v, causal=True)          # q, k, v: (batch, seqlen, heads, head_dim)
    out, lse = cuflash.attention(q, k, v, return_lse=True)  # lse: float32 (batch, heads, seqlen_q)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse)

q, k, v may be CuPy arrays, torch tensors (differentiable, torch.compile-able), JAX arrays (eager)
or other DLPack arrays on a CUDA device; results come back in the caller's framework, zero-copy.

CuPy, torch and jax are imported lazily, so `cuflash.reference` and the CLI's CPU fallback work
without a GPU, and torch/jax are only imported when their arrays are passed in.
"""
from __future__ import annotations

from ._version import __version__
from .api import attention, attention_backward
from .kvcache import attention_with_kvcache
from .varlen import attention_varlen, attention_varlen_backward
from .merge import merge_attention
from .block_mask import BlockMask
from .score_mods import ScoreMod, ScoreModError
from .device import CudaUnavailableError, UnsupportedDeviceError

__all__ = ["attention", "BlockMask", "ScoreMod", "ScoreModError", "attention_backward", "attention_with_kvcache", "attention_varlen", "attention_varlen_backward", "merge_attention", "UnsupportedDeviceError", "CudaUnavailableError",
           "__version__"]
