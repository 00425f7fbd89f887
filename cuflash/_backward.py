"""Backward pass: validate, pick configs, allocate gradients and workspaces, launch on CuPy's stream.

Launch sequence (kernels_cu/flash_bwd.cuh):
    bwd_prep        delta = rowsum(dO * O), lse2 = lse * log2(e) (+inf where P must be 0), dq_acc = 0
    flash_bwd_dkdv  dK, dV per key tile; dQ added to the fp32 dq_acc with atomics
    bwd_dq_convert  dq = softmax_scale * dq_acc, to the input dtype
With deterministic=True the atomics are off and flash_bwd_dq computes dQ in registers instead
(bitwise reproducible, three extra GEMMs).
"""
from __future__ import annotations

import numpy as np

from . import _compile, _dropout, _launch, _validate, families
from . import _plans as plan_cache
from ._launch import LOG2E
from .tiles import BwdConfig, DqConfig

# lse2 / delta / dq_acc rows are padded to this multiple (>= every block_q) so the kernels copy
# them with unguarded 16-byte loads.
_ROW_PAD = 128
_AUX_THREADS = 256


class _BwdPlan:
    __slots__ = ("device", "deterministic", "prep", "prep_grid", "main", "main_grid", "main_block", "main_smem",
                 "post", "post_grid", "post_block", "post_smem", "shapes", "dtype", "ws_rows", "head_dim",
                 "prep_tail", "main_tail", "post_tail")

    def __init__(self, p: _validate.FwdProblem, cfg: BwdConfig, dq_cfg: DqConfig | None, q, k, v, dout, out,
                 deterministic: bool):
        it = q.dtype.itemsize
        b, nq, nk, h, d = p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.head_dim
        pad = -(-nq // _ROW_PAD) * _ROW_PAD
        ch = d // 8
        i32, i64, f32 = np.int32, np.int64, np.float32

        def st(a):  # (batch, seqlen, heads) strides in elements
            return [i64(s // it) for s in a.strides[:3]]

        def fresh(n):  # strides of a fresh contiguous (b, n, h, d) gradient
            return [i64(n * h * d), i64(h * d), i64(d)]

        self.device, self.deterministic = p.device, deterministic
        self.shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        self.dtype, self.head_dim = q.dtype, d
        self.ws_rows = b * h * pad

        self.prep = _compile.get_aux_kernel("bwd_prep", p.features, p.device)
        self.prep_grid = (-(-self.ws_rows * ch // _AUX_THREADS),)
        self.prep_tail = (*st(out), *st(dout), i32(h), i32(nq), i32(pad), i64(self.ws_rows))

        n_blocks = -(-nk // cfg.block_k)
        grid = n_blocks * h * b
        _launch.check_grid(grid)
        self.main = _compile.get_kernel(cfg, p.features, p.device)
        self.main_grid, self.main_block, self.main_smem = (grid,), (cfg.threads,), cfg.smem_bytes
        scale_log2, scale = f32(p.softmax_scale * LOG2E), f32(p.softmax_scale)
        self.main_tail = (*st(q), *st(k), *st(v), *st(dout), *fresh(nk), *fresh(nk),
                          i32(h), i32(nq), i32(nk), i32(pad), i32(n_blocks), scale_log2, scale, i32(p.causal))

        if deterministic:
            m_blocks = -(-nq // dq_cfg.block_q)
            _launch.check_grid(m_blocks * h * b)
            self.post = _compile.get_kernel(dq_cfg, p.features, p.device)
            self.post_grid, self.post_block, self.post_smem = (m_blocks * h * b,), (dq_cfg.threads,), dq_cfg.smem_bytes
            self.post_tail = (*st(q), *st(k), *st(v), *st(dout), *fresh(nq),
                              i32(h), i32(nq), i32(nk), i32(pad), i32(m_blocks), scale_log2, scale, i32(p.causal))
        else:
            self.post = _compile.get_aux_kernel("bwd_dq_convert", p.features, p.device)
            n_rows = b * h * nq
            self.post_grid, self.post_block, self.post_smem = (-(-n_rows * ch // _AUX_THREADS),), (_AUX_THREADS,), 0
            self.post_tail = (*fresh(nq), i32(h), i32(nq), i32(pad), scale, i64(n_rows))

    def run(self, dout, q, k, v, out, lse, drop=_dropout.OFF):
        import cupy

        with cupy.cuda.Device(self.device):
            dq = cupy.empty(self.shapes[0], dtype=self.dtype)
            dk = cupy.empty(self.shapes[1], dtype=self.dtype)
            dv = cupy.empty(self.shapes[2], dtype=self.dtype)
            delta = cupy.empty(self.ws_rows, dtype=cupy.float32)
            lse2 = cupy.empty(self.ws_rows, dtype=cupy.float32)
            dq_acc = None if self.deterministic else cupy.empty(self.ws_rows * self.head_dim, dtype=cupy.float32)
            null = dq_acc if dq_acc is not None else np.uint64(0)
            self.prep(self.prep_grid, (_AUX_THREADS,), (out, dout, lse, delta, lse2, null, *self.prep_tail))
            self.main(self.main_grid, self.main_block, (q, k, v, dout, lse2, delta, null, dk, dv, *self.main_tail, *drop),
                      shared_mem=self.main_smem)
            if self.deterministic:
                self.post(self.post_grid, self.post_block, (q, k, v, dout, lse2, delta, dq, *self.post_tail, *drop),
                          shared_mem=self.post_smem)
            else:
                self.post(self.post_grid, self.post_block, (dq_acc, dq, *self.post_tail))
        return dq, dk, dv


_plans = plan_cache.PlanCache()


def _build_plan(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, config, dq_config,
                dropout=False) -> _BwdPlan:
    infos = [_validate.describe(x, n) for x, n in
             ((dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"))]
    p = _validate.check_backward(*infos, causal, softmax_scale, dropout)
    deterministic = _validate.check_flag(deterministic, "deterministic")
    cfg = _tile(families.BWD, config, p)
    dq_cfg = _tile(families.BWD_DQ, dq_config, p) if deterministic else None
    return _BwdPlan(p, cfg, dq_cfg, q, k, v, dout, out, bool(deterministic))


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
    drop = _dropout.kernel_args(dropout_p, seed)
    dropout = drop is not None
    if config is None and dq_config is None and all(type(a) is cupy.ndarray for a in arrays):
        plan = _plans.get(lambda: (*plan_cache.array_key(arrays), causal, softmax_scale, deterministic, dropout),
                          lambda: _build_plan(*arrays, causal, softmax_scale, deterministic, None, None, dropout))
    else:
        plan = _build_plan(*arrays, causal, softmax_scale, deterministic, config, dq_config, dropout)
    return plan.run(dout, q, k, v, out, lse, drop or _dropout.OFF)
