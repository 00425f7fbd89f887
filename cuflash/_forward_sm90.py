"""The Hopper forward's launch plan (families.FWD_SM90.plan): TMA descriptors of q, k, v per call.

The kernel (kernels_cu/flash_fwd_sm90.cuh) takes

    (const __grid_constant__ TmaMap tq, tk, tv, elem_t* out, float* lse, int* tile_counter, FwdParams' fields)

on a 1-D grid of (consumers + 1) * 128-thread blocks, with the tile's dynamic shared memory: one block
per work tile (m_blocks * heads * batch of them; persistent 0), or one per SM (persistent 1: each
strides over the tiles; 2: each draws its next tile from tile_counter, a per-stream int the kernel
leaves at 0, kernels_cu/sm90/tile_feed.cuh; null otherwise). Everything but the three maps is the sm80 forward's (the same FwdParams,
packed once per plan; out is written with ordinary stores at the strides FwdParams holds). The maps
embed the data pointers, so the plan's launch binds them per run (launch.Launch.bind): three
tma.MapCache lookups, which encode a map only for a pointer the plan has not seen lately.
"""
from __future__ import annotations

import numpy as np

from . import _compile, device, tma
from ._forward import INPUTS, INPUTS_VARLEN, OUTPUTS, output_buffers, with_mod_inputs
from .launch import Buffer, Launch, Plan, address, check_grid
from .params import pack_fwd
from .problem import AttnProblem
from .tiles import Sm90FwdConfig


def geometries(p: AttnProblem, cfg: Sm90FwdConfig) -> tuple:
    """The tensor-map geometries of q (boxes of block_q rows), k and v (block_k rows) of a problem
    (a column-masking instance's: the rank-4 form, one 64-column chunk per box)."""
    out = []
    for name, rows in (("q", cfg.block_q), ("k", cfg.block_k), ("v", cfg.block_k)):
        shape, strides = tma.tensor_layout(p, name)
        out.append(tma.map_geometry(shape, strides, p.dtype, rows, partial=p.features.partial_d))
    return tuple(out)


def binder(p: AttnProblem, cfg: Sm90FwdConfig, encoder=None):
    """slots (q, k, v, out, lse, tile_counter, then cu_seqlens_q / _k, alibi_slopes, mod_aux and a block mask's lists
    where the call has them) ->
    the kernel's leading arguments: map(q), map(k), map(v), the other slots as they are."""
    mq, mk, mv = (tma.MapCache(g, encoder=encoder) for g in geometries(p, cfg))

    def bind(slots):
        q, k, v = slots[:3]
        return (mq.get(address(q)), mk.get(address(k)), mv.get(address(v)), *slots[3:])

    bind.caches = (mq, mk, mv)  # tests, debugging
    return bind


def plan(p: AttnProblem, cfg: Sm90FwdConfig, dtype, encoder=None) -> Plan:
    # families.choose checked this already; say it plainly if a plan is built around the choice
    why = tma.tensors_problem(p) or (tma.bindings_problem() if encoder is None else None)
    if why:
        raise ValueError(f"the sm90 forward cannot take this call: {why}")
    # work tile = m_block + m_blocks * (head + heads * batch), as the sm80 forward (attn/scheduler.cuh);
    # the kernel strides over the tiles from blockIdx.x by gridDim.x, so any grid covers them:
    # one CTA per tile, or (persistent) one per SM
    m_blocks = -(-p.seqlen_q // cfg.block_q)
    tiles = m_blocks * p.heads * p.batch
    check_grid(tiles)
    grid = min(tiles, device.query(p.device).sm_count) if cfg.persistent else tiles
    kernel = _compile.get_kernel(cfg, p.features, p.device)
    inputs = INPUTS_VARLEN if p.varlen else INPUTS
    inputs = with_mod_inputs(p, inputs)  # alibi_slopes, mod_aux after every other pointer, as the sm80 forward's
    # the kernel's pointers: the inputs with the tile counter after lse
    pointers = (*inputs[:5], "tile_counter", *inputs[5:])
    counter = Buffer("tile_counter", (1,) if cfg.persistent == 2 else None, np.int32, per_stream=True)
    launch = Launch(kernel, (max(grid, 1),), (cfg.threads,), cfg.smem_bytes, pointers=pointers,
                    bind=binder(p, cfg, encoder))
    params = pack_fwd(p, m_blocks)
    if p.block_mask is not None:  # entries per key-block list: the tile's key blocks
        params["bm_nb"] = -(-p.seqlen_k // cfg.block_k)
    return Plan(p.device, inputs, (*output_buffers(p, dtype), counter), (launch,), OUTPUTS, params)
