"""Launch code the forward plans (v2, v1) share: kernel scalars, the plan-cached call, output checks."""
from __future__ import annotations

import numpy as np

from . import _dropout, _validate, families
from . import _plans as plan_cache

LOG2E = 1.4426950408889634  # the kernels use exp2: scores are scaled by softmax_scale * log2(e)
# Grids are 1-D; blockIdx.x's limit is 2^31 - 1.
MAX_GRID_X = 2**31 - 1


def check_grid(n_blocks: int) -> None:
    if n_blocks > MAX_GRID_X:
        raise ValueError(f"problem too large: {n_blocks} thread blocks exceed the grid limit {MAX_GRID_X}")


def scalar_args(p: _validate.FwdProblem, q, k, v, m_blocks: int) -> tuple:
    """The kernel arguments after the pointers (CUFLASH_FWD_PARAMS, CUFLASH_FWDV1_PARAMS), dropout's
    three excepted: per tensor (batch, seqlen, heads) strides in elements, then the sizes."""
    it = q.dtype.itemsize
    out_strides = (p.seqlen_q * p.heads * p.head_dim, p.heads * p.head_dim, p.head_dim)  # fresh contiguous out
    strides = [np.int64(s // it) for a in (q, k, v) for s in a.strides[:3]] + [np.int64(s) for s in out_strides]
    return (*strides, np.int32(p.heads), np.int32(p.seqlen_q), np.int32(p.seqlen_k), np.int32(m_blocks),
            np.float32(p.softmax_scale * LOG2E), np.int32(p.causal))


def run_forward(family: families.KernelFamily, plan_class, plans: plan_cache.PlanCache, q, k, v, *, causal,
                softmax_scale, dropout_p, seed, config, out, lse):
    """The body the v2 and v1 forwards share: dropout arguments, the cached (or, with an explicit
    config, fresh) launch plan, optional output buffers, the launch.

    plan_class(problem, tile, q, k, v) builds a plan; the tile is `config` when given (checked
    against the family and the problem), else families.select(family, problem).
    """
    import cupy

    drop = _dropout.kernel_args(dropout_p, seed)
    dropout = drop is not None

    def build(cfg):
        qi, ki, vi = (_validate.describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        p = _validate.check_forward(qi, ki, vi, causal, softmax_scale, dropout)
        if cfg is None:
            cfg = families.select(family, p)
        else:
            family.check_explicit(cfg, p.features)
        return plan_class(p, cfg, q, k, v)

    if config is None and type(q) is type(k) is type(v) is cupy.ndarray:
        plan = plans.get(lambda: (*plan_cache.array_key((q, k, v)), causal, softmax_scale, dropout),
                         lambda: build(None))
    else:
        plan = build(config)
    if out is not None:
        out = _checked_out(out, q)
    if lse is not None:
        lse = _checked_lse(lse, plan.lse_shape)
    return plan.run(q, k, v, out, lse, drop or _dropout.OFF)


def _checked_out(out, q):
    info = _validate.describe(out, "out")
    if info.shape != tuple(q.shape) or info.dtype != q.dtype.name or info.device != q.device.id:
        raise ValueError(f"out must match q (shape {tuple(q.shape)}, dtype {q.dtype.name}, device {q.device.id}), "
                         f"got shape {info.shape}, dtype {info.dtype}, device {info.device}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    return out


def _checked_lse(lse, shape):
    import cupy

    if not isinstance(lse, cupy.ndarray) or lse.shape != shape or lse.dtype != cupy.float32 or not lse.flags.c_contiguous:
        raise ValueError(f"lse must be a contiguous float32 CuPy array of shape {shape}")
    return lse
