"""Forward pass: validate, pick a config, allocate outputs, launch on CuPy's current stream."""
from __future__ import annotations

import functools
import math

import numpy as np

from . import _compile, _configs, _validate

LOG2E = 1.4426950408889634
# Grid is 1-D (blockIdx.x = m_block + m_blocks * (head + heads * batch)); its limit is 2^31 - 1.
_MAX_GRID_X = 2**31 - 1


@functools.lru_cache(maxsize=None)
def _smem_optin(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)["sharedMemPerBlockOptin"]


def select_fwd_config(problem: _validate.FwdProblem) -> _configs.FwdConfig:
    return _configs.default_fwd_config(problem.head_dim, _smem_optin(problem.device))


def forward(q, k, v, *, causal=False, softmax_scale=None, config: _configs.FwdConfig | None = None,
            out=None, lse=None):
    """Returns (out, lse): out like q, lse float32 (batch, heads, seqlen_q).

    `out` and `lse` may be given (internal: tests poison them, the backward reuses them); otherwise
    fresh contiguous arrays are allocated. `config` overrides the selected kernel config.
    """
    import cupy

    qi, ki, vi = (_validate.describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    p = _validate.check_forward(qi, ki, vi, causal, softmax_scale)
    cfg = config or select_fwd_config(p)
    m_blocks = -(-p.seqlen_q // cfg.block_q)
    n_blocks = m_blocks * p.heads * p.batch
    if n_blocks > _MAX_GRID_X:
        raise ValueError(f"problem too large: {n_blocks} thread blocks exceed the grid limit {_MAX_GRID_X}")

    with cupy.cuda.Device(p.device):
        out = cupy.empty(q.shape, dtype=q.dtype) if out is None else _checked_out(out, q)
        lse_shape = (p.batch, p.heads, p.seqlen_q)
        lse = cupy.empty(lse_shape, dtype=cupy.float32) if lse is None else _checked_lse(lse, lse_shape)
        kern = _compile.get_fwd_kernel(cfg, p.dtype, p.device)
        es = [a.strides for a in (q, k, v, out)]
        it = q.dtype.itemsize
        strides = [np.int64(s // it) for st in es for s in st[:3]]
        # strides come in (batch, seqlen, heads) order per tensor, matching CUFLASH_FWD_PARAMS
        kern(
            (n_blocks,), (cfg.threads,),
            (q, k, v, out, lse, *strides,
             np.int32(p.heads), np.int32(p.seqlen_q), np.int32(p.seqlen_k), np.int32(m_blocks),
             np.float32(p.softmax_scale * LOG2E), np.int32(p.causal)),
            shared_mem=cfg.smem_bytes,
        )
    return out, lse


def _checked_out(out, q):
    info = _validate.describe(out, "out")
    if info.shape != tuple(q.shape) or info.dtype != q.dtype.name or info.device != q.device.id:
        raise ValueError(f"out must match q (shape {tuple(q.shape)}, dtype {q.dtype.name}, device {q.device.id}), "
                         f"got shape {info.shape}, dtype {info.dtype}, device {info.device}")
    _validate.check_layout(info, "out")
    return out


def _checked_lse(lse, shape):
    import cupy

    if not isinstance(lse, cupy.ndarray) or lse.shape != shape or lse.dtype != cupy.float32 or not lse.flags.c_contiguous:
        raise ValueError(f"lse must be a contiguous float32 CuPy array of shape {shape}")
    return lse
