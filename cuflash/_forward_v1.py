"""v1 forward (FlashAttention-1, Algorithm 1): validate, pick a config, allocate, launch.

Same arguments, checks, outputs and semantics as the v2 forward (cuflash/_forward.py); the kernel is
kernels_cu/flash_fwd_v1.cuh. It exists to measure the algorithm against v2 (docs/roofline.md):
one thread block per (batch, head), K/V tiles in the outer loop, and O, m, l in an fp32 workspace
in device memory, allocated per call from CuPy's memory pool on the current stream.
"""
from __future__ import annotations

import numpy as np

from . import _compile, families
from . import _plans as plan_cache
from ._forward import INPUTS, OUTPUTS, output_buffers, run_forward
from .launch import Buffer, Launch, Plan, check_grid
from .mask import MaskOptions
from .params import pack_fwd
from .problem import AttnProblem
from .tiles import V1Config


def workspace_elements(batch: int, heads: int, seqlen_q: int, seqlen_k: int, cfg: V1Config) -> tuple[int, int]:
    """fp32 elements of the (O, (m, l)) workspace; none is read or written when one K/V tile covers seqlen_k."""
    if seqlen_k <= cfg.block_k:
        return 1, 1
    rows = batch * heads * seqlen_q
    return rows * cfg.head_dim, rows * 2


def _plan(p: AttnProblem, cfg: V1Config, dtype) -> Plan:
    n_blocks = p.batch * p.heads  # one block per (batch, head): blockIdx.x = head + heads * batch
    check_grid(n_blocks)
    m_blocks = -(-p.seqlen_q // cfg.block_q)
    kernel = _compile.get_kernel(cfg, p.features, p.device)
    # The workspace is uninitialised: the kernel writes every element before reading it.
    ws_o, ws_ml = workspace_elements(p.batch, p.heads, p.seqlen_q, p.seqlen_k, cfg)
    buffers = (*output_buffers(p, dtype), Buffer("ws_o", (ws_o,), np.float32),
               Buffer("ws_ml", (ws_ml,), np.float32))
    launch = Launch(kernel, (n_blocks,), (cfg.threads,), cfg.smem_bytes, pointers=(*INPUTS, "ws_o", "ws_ml"))
    return Plan(p.device, INPUTS, buffers, (launch,), OUTPUTS, pack_fwd(p, m_blocks))  # v2's FwdParams


_plans = plan_cache.PlanCache(1024)


def forward_v1(q, k, v, *, mask: MaskOptions | None = None, softmax_scale=None, dropout_p=0.0, seed=None,
               config: V1Config | None = None, out=None, lse=None, backend: str | None = None, **mask_options):
    """FlashAttention-1 forward. Returns (out, lse): out like q, lse float32 (batch, heads, seqlen_q).

    Arguments and results are those of the v2 forward (cuflash.attention): q (batch, seqlen_q,
    heads, head_dim), k and v (batch, seqlen_k, heads, head_dim), fp16 or bf16 CuPy arrays with a
    contiguous last dimension; the mask as `mask` or its keywords (causal=..., as the v2 forward); lse in natural log, -inf (and out 0) for
    rows that see no key. `out`/`lse` may be given (internal: tests poison them); `config`
    overrides the selected kernel config. Runs on CuPy's current stream. `backend`: None or "sm80"
    (the v1 kernel is mma.sync only: "sm90" raises ValueError; CUFLASH_BACKEND does not apply).
    """
    if mask_options or type(mask) is not MaskOptions:
        mask = MaskOptions.given(mask, mask_options)
    return run_forward((families.FWD_V1,), _plans, q, k, v, mask=mask, softmax_scale=softmax_scale,
                       dropout_p=dropout_p, seed=seed, config=config, out=out, lse=lse, backend=backend)
