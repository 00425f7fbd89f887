"""Forward pass (v2 algorithm): validate, pick a config, allocate outputs, launch on CuPy's current stream.

Also the body the v1 forward shares (run_forward). Both forwards' kernels take FwdParams
(cuflash/params.py), packed once per plan.
"""
from __future__ import annotations

import numpy as np

from . import _compile, families, problem
from . import _plans as plan_cache
from .launch import Buffer, Launch, Plan, check_grid
from .params import pack_fwd
from .problem import AttnProblem
from .tiles import FwdConfig

INPUTS = ("q", "k", "v", "out", "lse")  # Plan.run's arguments; out and lse may be None (allocated)
OUTPUTS = ("out", "lse")


def output_buffers(p: AttnProblem, dtype) -> tuple:
    """out (like q) and lse (float32 (batch, heads, seqlen_q)), when the caller gives none."""
    return (Buffer("out", (p.batch, p.seqlen_q, p.heads, p.head_dim), dtype),
            Buffer("lse", (p.batch, p.heads, p.seqlen_q), np.float32))


def _plan(p: AttnProblem, cfg: FwdConfig, dtype) -> Plan:
    # blockIdx.x = m_block + m_blocks * (head + heads * batch)
    m_blocks = -(-p.seqlen_q // cfg.block_q)
    n_blocks = m_blocks * p.heads * p.batch
    check_grid(n_blocks)
    kernel = _compile.get_kernel(cfg, p.features, p.device)
    launch = Launch(kernel, (n_blocks,), (cfg.threads,), cfg.smem_bytes, pointers=INPUTS)
    return Plan(p.device, INPUTS, output_buffers(p, dtype), (launch,), OUTPUTS, pack_fwd(p, m_blocks))


def run_forward(family: families.KernelFamily, build_plan, plans: plan_cache.PlanCache, q, k, v, *, causal,
                softmax_scale, dropout_p, seed, config, out, lse):
    """The body the v2 and v1 forwards share: the call's dropout, the cached (or, with an explicit
    config, fresh) launch plan, optional output buffers, the launch.

    build_plan(problem, tile, dtype) builds a plan; the tile is `config` when given (checked
    against the family and the problem), else families.select(family, problem).
    """
    import cupy

    dropout = problem.resolve_dropout(dropout_p, seed)

    def build(cfg):
        infos = (problem.describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        p = problem.resolve_forward(*infos, causal, softmax_scale, dropout)
        if cfg is None:
            cfg = families.select(family, p)
        else:
            family.check_explicit(cfg, p.features)
        return build_plan(p, cfg, q.dtype)

    if config is None and type(q) is type(k) is type(v) is cupy.ndarray:
        plan = plans.get(lambda: (*plan_cache.array_key((q, k, v)), causal, softmax_scale, dropout is not None),
                         lambda: build(None))
    else:
        plan = build(config)
    if out is not None:
        out = _checked_out(out, q)
    if lse is not None:
        lse = _checked_lse(lse, (q.shape[0], q.shape[2], q.shape[1]))
    return plan.run((q, k, v, out, lse), None if dropout is None else dropout.kernel_args)


def _checked_out(out, q):
    info = problem.describe(out, "out")
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


_plans = plan_cache.PlanCache()


def forward(q, k, v, *, causal=False, softmax_scale=None, dropout_p=0.0, seed=None,
            config: FwdConfig | None = None, out=None, lse=None):
    """Returns (out, lse): out like q, lse float32 (batch, heads, seqlen_q).

    dropout_p > 0 drops attention probabilities with the Philox mask of `seed` (an int; the same
    seed must go to the backward); lse is that of the undropped scores.
    `out` and `lse` may be given (internal: tests poison them, the backward reuses them); otherwise
    fresh contiguous arrays are allocated. `config` overrides the selected kernel config.
    """
    return run_forward(families.FWD, _plan, _plans, q, k, v, causal=causal, softmax_scale=softmax_scale,
                       dropout_p=dropout_p, seed=seed, config=config, out=out, lse=lse)
