"""Forward pass: validate, pick a config, allocate outputs, launch on CuPy's current stream."""
from __future__ import annotations


import numpy as np

from . import _compile, _configs, _device, _dropout, _tuned, _validate
from . import _plans as _plans_mod

LOG2E = 1.4426950408889634
# Grid is 1-D (blockIdx.x = m_block + m_blocks * (head + heads * batch)); its limit is 2^31 - 1.
_MAX_GRID_X = 2**31 - 1


def select_fwd_config(problem: _validate.FwdProblem, dropout: bool = False) -> _configs.FwdConfig:
    # Tuned tables hold the plain kernel's winners; the dropout variant uses the heuristic, which
    # avoids configs whose dropout instantiation spills.
    cfg = None if dropout else _tuned.lookup("fwd", problem)  # the user's tuning cache, then the shipped tables
    return cfg if cfg is not None else _configs.default_fwd_config(
        problem.head_dim, _device.smem_optin(problem.device), dropout)


class _FwdPlan:
    """Everything about a launch that depends only on shapes, strides, dtype, device and options.

    Built once (full validation included) and cached, so a repeated call costs a dict lookup, two
    allocations and the launch.
    """

    __slots__ = ("device", "kernel", "grid", "block", "smem", "out_shape", "dtype", "lse_shape", "tail")

    def __init__(self, p: _validate.FwdProblem, cfg: _configs.FwdConfig, q, k, v, dropout: bool = False):
        m_blocks = -(-p.seqlen_q // cfg.block_q)
        n_blocks = m_blocks * p.heads * p.batch
        if n_blocks > _MAX_GRID_X:
            raise ValueError(f"problem too large: {n_blocks} thread blocks exceed the grid limit {_MAX_GRID_X}")
        self.device = p.device
        self.kernel = _compile.get_kernel(cfg, p.dtype, p.device, dropout)
        self.grid, self.block, self.smem = (n_blocks,), (cfg.threads,), cfg.smem_bytes
        self.out_shape, self.dtype = tuple(q.shape), q.dtype
        self.lse_shape = (p.batch, p.heads, p.seqlen_q)
        self.tail = scalar_args(p, q, k, v, m_blocks)

    def run(self, q, k, v, out=None, lse=None, drop=_dropout.OFF):
        import cupy

        with cupy.cuda.Device(self.device):
            if out is None:
                out = cupy.empty(self.out_shape, dtype=self.dtype)
            if lse is None:
                lse = cupy.empty(self.lse_shape, dtype=cupy.float32)
            self.kernel(self.grid, self.block, (q, k, v, out, lse, *self.tail, *drop), shared_mem=self.smem)
        return out, lse


def scalar_args(p: _validate.FwdProblem, q, k, v, m_blocks: int) -> tuple:
    """The kernel arguments after the pointers (CUFLASH_FWD_PARAMS, CUFLASH_FWDV1_PARAMS), dropout's
    three excepted: per tensor (batch, seqlen, heads) strides in elements, then the sizes."""
    it = q.dtype.itemsize
    out_strides = (p.seqlen_q * p.heads * p.head_dim, p.heads * p.head_dim, p.head_dim)  # fresh contiguous out
    strides = [np.int64(s // it) for a in (q, k, v) for s in a.strides[:3]] + [np.int64(s) for s in out_strides]
    return (*strides, np.int32(p.heads), np.int32(p.seqlen_q), np.int32(p.seqlen_k), np.int32(m_blocks),
            np.float32(p.softmax_scale * LOG2E), np.int32(p.causal))


_plans = _plans_mod.PlanCache()


def forward(q, k, v, *, causal=False, softmax_scale=None, dropout_p=0.0, seed=None,
            config: _configs.FwdConfig | None = None, out=None, lse=None):
    """Returns (out, lse): out like q, lse float32 (batch, heads, seqlen_q).

    dropout_p > 0 drops attention probabilities with the Philox mask of `seed` (an int; the same
    seed must go to the backward); lse is that of the undropped scores.
    `out` and `lse` may be given (internal: tests poison them, the backward reuses them); otherwise
    fresh contiguous arrays are allocated. `config` overrides the selected kernel config.
    """
    return run_forward(_plans, _FwdPlan, select_fwd_config, None, q, k, v, causal, softmax_scale, dropout_p, seed,
                       config, out, lse)


def run_forward(plans, plan_class, select, config_type, q, k, v, causal, softmax_scale, dropout_p, seed, config,
                out, lse):
    """The body the v2 and v1 forwards share: dropout arguments, the cached (or, with an explicit
    config, fresh) launch plan, optional output buffers, the launch.

    plan_class(problem, cfg, q, k, v, dropout) builds a plan; select(problem, dropout) picks the
    config when none is given; config_type, when set, is the only config class accepted.
    """
    import cupy

    drop = _dropout.kernel_args(dropout_p, seed)
    dropout = drop is not None

    def build(cfg):
        qi, ki, vi = (_validate.describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        p = _validate.check_forward(qi, ki, vi, causal, softmax_scale)
        if cfg is not None and config_type is not None and not isinstance(cfg, config_type):
            raise TypeError(f"config must be a {config_type.__name__}, got {type(cfg).__name__}")
        return plan_class(p, cfg or select(p, dropout), q, k, v, dropout)

    if config is None and type(q) is type(k) is type(v) is cupy.ndarray:
        plan = plans.get(lambda: (*_plans_mod.array_key((q, k, v)), causal, softmax_scale, dropout),
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
