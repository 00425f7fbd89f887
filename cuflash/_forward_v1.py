"""v1 forward (FlashAttention-1, Algorithm 1): validate, pick a config, allocate, launch.

Same arguments, checks, outputs and semantics as the v2 forward (cuflash/_forward.py); the kernel is
kernels_cu/flash_fwd_v1.cuh. It exists to measure the algorithm against v2 (docs/roofline.md):
one thread block per (batch, head), K/V tiles in the outer loop, and O, m, l in an fp32 workspace
in device memory, allocated per call from CuPy's memory pool on the current stream.
"""
from __future__ import annotations


from . import _compile, _dropout, _launch, _validate, families
from . import _plans as plan_cache
from .tiles import V1Config


def workspace_elements(batch: int, heads: int, seqlen_q: int, seqlen_k: int, cfg: V1Config) -> tuple[int, int]:
    """fp32 elements of the (O, (m, l)) workspace; none is read or written when one K/V tile covers seqlen_k."""
    if seqlen_k <= cfg.block_k:
        return 1, 1
    rows = batch * heads * seqlen_q
    return rows * cfg.head_dim, rows * 2


class _V1Plan:
    """Everything about a launch that depends only on shapes, strides, dtype, device and options."""

    __slots__ = ("device", "kernel", "grid", "block", "smem", "out_shape", "dtype", "lse_shape", "ws", "tail")

    def __init__(self, p: _validate.FwdProblem, cfg: V1Config, q, k, v):
        n_blocks = p.batch * p.heads  # one block per (batch, head): blockIdx.x = head + heads * batch
        _launch.check_grid(n_blocks)
        m_blocks = -(-p.seqlen_q // cfg.block_q)
        self.device = p.device
        self.kernel = _compile.get_kernel(cfg, p.features, p.device)
        self.grid, self.block, self.smem = (n_blocks,), (cfg.threads,), cfg.smem_bytes
        self.out_shape, self.dtype = tuple(q.shape), q.dtype
        self.lse_shape = (p.batch, p.heads, p.seqlen_q)
        self.ws = workspace_elements(p.batch, p.heads, p.seqlen_q, p.seqlen_k, cfg)
        self.tail = _launch.scalar_args(p, q, k, v, m_blocks)  # same parameter list as v2's

    def run(self, q, k, v, out=None, lse=None, drop=_dropout.OFF):
        import cupy

        with cupy.cuda.Device(self.device):
            if out is None:
                out = cupy.empty(self.out_shape, dtype=self.dtype)
            if lse is None:
                lse = cupy.empty(self.lse_shape, dtype=cupy.float32)
            # Workspace from the pool, uninitialised: the kernel writes every element before reading it.
            ws_o = cupy.empty(self.ws[0], dtype=cupy.float32)
            ws_ml = cupy.empty(self.ws[1], dtype=cupy.float32)
            self.kernel(self.grid, self.block, (q, k, v, out, lse, ws_o, ws_ml, *self.tail, *drop), shared_mem=self.smem)
        # ws_o / ws_ml go back to the pool when they die here; the pool reuses a block only for work
        # queued later on the same stream, so the running kernel keeps it.
        return out, lse


_plans = plan_cache.PlanCache(1024)


def forward_v1(q, k, v, *, causal=False, softmax_scale=None, dropout_p=0.0, seed=None,
               config: V1Config | None = None, out=None, lse=None):
    """FlashAttention-1 forward. Returns (out, lse): out like q, lse float32 (batch, heads, seqlen_q).

    Arguments and results are those of the v2 forward (cuflash.attention): q (batch, seqlen_q,
    heads, head_dim), k and v (batch, seqlen_k, heads, head_dim), fp16 or bf16 CuPy arrays with a
    contiguous last dimension; bottom-right causal mask; lse in natural log, -inf (and out 0) for
    rows that see no key. `out`/`lse` may be given (internal: tests poison them); `config`
    overrides the selected kernel config. Runs on CuPy's current stream.
    """
    return _launch.run_forward(families.FWD_V1, _V1Plan, _plans, q, k, v, causal=causal,
                               softmax_scale=softmax_scale, dropout_p=dropout_p, seed=seed, config=config, out=out,
                               lse=lse)
