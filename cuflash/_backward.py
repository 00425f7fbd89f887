"""Backward pass: validate, pick configs, allocate gradients and workspaces, launch on CuPy's stream.

Launch sequence (kernels_cu/flash_bwd.cuh):
    bwd_prep        delta = rowsum(dO * O), lse2 = lse * log2(e) (+inf where P must be 0), dq_acc = 0
    flash_bwd_dkdv  dK, dV per key tile; dQ added to the fp32 dq_acc with atomics
    bwd_dq_convert  dq = softmax_scale * dq_acc, to the input dtype
With deterministic=True the atomics are off and flash_bwd_dq computes dQ in registers instead
(bitwise reproducible, three extra GEMMs); there is no dq_acc then, and the kernels that take it
get a null pointer.
"""
from __future__ import annotations

import numpy as np

from . import _compile, families, problem
from . import _plans as plan_cache
from .launch import LOG2E, Buffer, Launch, Plan, check_grid, contiguous_strides, int64s
from .problem import AttnProblem
from .signature import BWD_ARRAYS
from .tiles import BwdConfig, DqConfig

# lse2 / delta / dq_acc rows are padded to this multiple (>= every block_q) so the kernels copy
# them with unguarded 16-byte loads.
_ROW_PAD = 128
_AUX_THREADS = 256
OUTPUTS = ("dq", "dk", "dv")


# --- the scalar tail of each kernel (the parameters after the pointers, dropout's three excepted)

def _prep_tail(p: AttnProblem, pad: int, ws_rows: int) -> tuple:  # CUFLASH_PREP_PARAMS
    return (*int64s(p.strides["out"], p.strides["dout"]), np.int32(p.heads), np.int32(p.seqlen_q), np.int32(pad),
            np.int64(ws_rows))


def _dkdv_tail(p: AttnProblem, pad: int, n_blocks: int) -> tuple:  # CUFLASH_BWD_PARAMS
    s, fresh_k = p.strides, contiguous_strides(p.seqlen_k, p.heads, p.head_dim)
    return (*int64s(s["q"], s["k"], s["v"], s["dout"], fresh_k, fresh_k),  # dk, dv
            np.int32(p.heads), np.int32(p.seqlen_q), np.int32(p.seqlen_k), np.int32(pad), np.int32(n_blocks),
            np.float32(p.softmax_scale * LOG2E), np.float32(p.softmax_scale), np.int32(p.causal))


def _dq_tail(p: AttnProblem, pad: int, m_blocks: int) -> tuple:  # CUFLASH_DQ_PARAMS
    s = p.strides
    return (*int64s(s["q"], s["k"], s["v"], s["dout"], contiguous_strides(p.seqlen_q, p.heads, p.head_dim)),  # dq
            np.int32(p.heads), np.int32(p.seqlen_q), np.int32(p.seqlen_k), np.int32(pad), np.int32(m_blocks),
            np.float32(p.softmax_scale * LOG2E), np.float32(p.softmax_scale), np.int32(p.causal))


def _convert_tail(p: AttnProblem, pad: int, n_rows: int) -> tuple:  # CUFLASH_CONVERT_PARAMS
    return (*int64s(contiguous_strides(p.seqlen_q, p.heads, p.head_dim)), np.int32(p.heads), np.int32(p.seqlen_q),
            np.int32(pad), np.float32(p.softmax_scale), np.int64(n_rows))


def _plan(p: AttnProblem, cfg: BwdConfig, dq_cfg: DqConfig | None, dtype) -> Plan:
    b, nq, nk, h, d = p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.head_dim
    pad = -(-nq // _ROW_PAD) * _ROW_PAD
    ws_rows = b * h * pad
    chunks = d // 8  # the aux kernels' threads each take 8 elements of a row

    prep = _compile.get_aux_kernel("bwd_prep", p.features, p.device)
    launches = [Launch(prep, (-(-ws_rows * chunks // _AUX_THREADS),), (_AUX_THREADS,), 0,
                       pointers=("out", "dout", "lse", "delta", "lse2", "dq_acc"), tail=_prep_tail(p, pad, ws_rows),
                       dropout=False)]

    n_blocks = -(-nk // cfg.block_k)
    check_grid(n_blocks * h * b)
    main = _compile.get_kernel(cfg, p.features, p.device)
    launches.append(Launch(main, (n_blocks * h * b,), (cfg.threads,), cfg.smem_bytes,
                           pointers=("q", "k", "v", "dout", "lse2", "delta", "dq_acc", "dk", "dv"),
                           tail=_dkdv_tail(p, pad, n_blocks), dropout=True))

    if p.deterministic:
        m_blocks = -(-nq // dq_cfg.block_q)
        check_grid(m_blocks * h * b)
        dq_kernel = _compile.get_kernel(dq_cfg, p.features, p.device)
        launches.append(Launch(dq_kernel, (m_blocks * h * b,), (dq_cfg.threads,), dq_cfg.smem_bytes,
                               pointers=("q", "k", "v", "dout", "lse2", "delta", "dq"),
                               tail=_dq_tail(p, pad, m_blocks), dropout=True))
    else:
        convert = _compile.get_aux_kernel("bwd_dq_convert", p.features, p.device)
        n_rows = b * h * nq
        launches.append(Launch(convert, (-(-n_rows * chunks // _AUX_THREADS),), (_AUX_THREADS,), 0,
                               pointers=("dq_acc", "dq"), tail=_convert_tail(p, pad, n_rows), dropout=False))

    buffers = (Buffer("dq", (b, nq, h, d), dtype), Buffer("dk", (b, nk, h, d), dtype),
               Buffer("dv", (b, nk, h, d), dtype), Buffer("delta", (ws_rows,)), Buffer("lse2", (ws_rows,)),
               Buffer("dq_acc", None if p.deterministic else (ws_rows * d,)))
    return Plan(p.device, BWD_ARRAYS, buffers, tuple(launches), OUTPUTS)


_plans = plan_cache.PlanCache()


def _build_plan(arrays, causal, softmax_scale, deterministic, dropout, config, dq_config) -> Plan:
    infos = [problem.describe(x, n) for x, n in zip(arrays, BWD_ARRAYS)]
    p = problem.resolve_backward(*infos, causal, softmax_scale, deterministic, dropout)
    cfg = _tile(families.BWD, config, p)
    dq_cfg = _tile(families.BWD_DQ, dq_config, p) if p.deterministic else None
    return _plan(p, cfg, dq_cfg, arrays[1].dtype)


def _tile(family, config, p):
    """The caller's tile (checked against family and problem), else the selected one."""
    if config is None:
        return families.select(family, p)
    family.check_explicit(config, p.features)
    return config


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, deterministic=False, dropout_p=0.0,
             seed=None, config: BwdConfig | None = None, dq_config: DqConfig | None = None):
    """Gradients (dq, dk, dv) of attention for upstream gradient `dout`; CuPy arrays like q, k, v.

    `out` and `lse` are the forward's results for the same q, k, v, causal, softmax_scale,
    dropout_p and seed (the dropout mask is regenerated from the seed, never stored).
    `config` / `dq_config` override the selected kernel configs (tuner, tests).
    """
    import cupy

    arrays = (dout, q, k, v, out, lse)
    dropout = problem.resolve_dropout(dropout_p, seed)
    if config is None and dq_config is None and all(type(a) is cupy.ndarray for a in arrays):
        plan = _plans.get(lambda: (*plan_cache.array_key(arrays), causal, softmax_scale, deterministic,
                                   dropout is not None),
                          lambda: _build_plan(arrays, causal, softmax_scale, deterministic, dropout, None, None))
    else:
        plan = _build_plan(arrays, causal, softmax_scale, deterministic, dropout, config, dq_config)
    return plan.run(arrays, problem.NO_DROPOUT_ARGS if dropout is None else dropout.kernel_args)
