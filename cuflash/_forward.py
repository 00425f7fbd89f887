"""Forward pass (v2 algorithm): validate, pick a config, allocate outputs, launch on CuPy's current stream."""
from __future__ import annotations

from . import _compile, _dropout, _launch, _validate, families
from . import _plans as plan_cache
from .tiles import FwdConfig


class _FwdPlan:
    """Everything about a launch that depends only on shapes, strides, dtype, device and options.

    Built once (full validation included) and cached, so a repeated call costs a dict lookup, two
    allocations and the launch.
    """

    __slots__ = ("device", "kernel", "grid", "block", "smem", "out_shape", "dtype", "lse_shape", "tail")

    def __init__(self, p: _validate.FwdProblem, cfg: FwdConfig, q, k, v):
        # blockIdx.x = m_block + m_blocks * (head + heads * batch)
        m_blocks = -(-p.seqlen_q // cfg.block_q)
        n_blocks = m_blocks * p.heads * p.batch
        _launch.check_grid(n_blocks)
        self.device = p.device
        self.kernel = _compile.get_kernel(cfg, p.features, p.device)
        self.grid, self.block, self.smem = (n_blocks,), (cfg.threads,), cfg.smem_bytes
        self.out_shape, self.dtype = tuple(q.shape), q.dtype
        self.lse_shape = (p.batch, p.heads, p.seqlen_q)
        self.tail = _launch.scalar_args(p, q, k, v, m_blocks)

    def run(self, q, k, v, out=None, lse=None, drop=_dropout.OFF):
        import cupy

        with cupy.cuda.Device(self.device):
            if out is None:
                out = cupy.empty(self.out_shape, dtype=self.dtype)
            if lse is None:
                lse = cupy.empty(self.lse_shape, dtype=cupy.float32)
            self.kernel(self.grid, self.block, (q, k, v, out, lse, *self.tail, *drop), shared_mem=self.smem)
        return out, lse


_plans = plan_cache.PlanCache()


def forward(q, k, v, *, causal=False, softmax_scale=None, dropout_p=0.0, seed=None,
            config: FwdConfig | None = None, out=None, lse=None):
    """Returns (out, lse): out like q, lse float32 (batch, heads, seqlen_q).

    dropout_p > 0 drops attention probabilities with the Philox mask of `seed` (an int; the same
    seed must go to the backward); lse is that of the undropped scores.
    `out` and `lse` may be given (internal: tests poison them, the backward reuses them); otherwise
    fresh contiguous arrays are allocated. `config` overrides the selected kernel config.
    """
    return _launch.run_forward(families.FWD, _FwdPlan, _plans, q, k, v, causal=causal, softmax_scale=softmax_scale,
                               dropout_p=dropout_p, seed=seed, config=config, out=out, lse=lse)
