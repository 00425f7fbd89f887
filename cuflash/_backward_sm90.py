"""The Hopper backward's main kernel in a backward plan (families.BWD_SM90.main_args).

kernels_cu/flash_bwd_sm90.cuh takes

    (const __grid_constant__ TmaMap tq, tk, tv, tdo, const float* lse2, const float* delta,
     float* dq_acc, elem_t* dk, elem_t* dv, int* dq_sem, [optional pointers], BwdParams' fields)

and runs where the sm80 backward's dK/dV kernel runs, between bwd_prep and bwd_dq_convert
(cuflash/_backward.py), on a grid of n_blocks * heads * batch CTAs of 128 keys. dq_sem: the
deterministic mode's turn counters, one per 64 x 64 dQ block (zeroed per call; null otherwise).
The maps embed the data pointers, so the launch binds them per run from the plan's slots
(tma.MapCache per tensor).
"""
from __future__ import annotations

from . import tma
from .launch import address

# The plan slots the kernel reads, in its parameter order (the four tensors become maps).
SLOTS = ("q", "k", "v", "dout", "lse2", "delta", "dq_acc", "dk", "dv", "dq_sem")


def call_problem(p) -> str | None:
    """Why the Hopper backward cannot take this call (an AttnProblem), or None."""
    if p.deterministic and p.block_mask is not None:
        return "the sm90 backward's deterministic mode does not take block masks"
    if p.deterministic and p.head_dim > 128:
        return "the sm90 backward's deterministic mode stops at head_dim 128 (the split-head-dim tile adds dQ by atomics)"
    return tma.tensors_problem(p, ("q", "k", "v", "dout")) or tma.bindings_problem()


def main_args(p, cfg, encoder=None):
    """(SLOTS, bind): bind(q, k, v, dout, lse2, delta, dq_acc, dk, dv, dq_sem, ...) -> the kernel's leading arguments."""
    caches = []
    for name, rows in (("q", cfg.block_q), ("k", cfg.block_k), ("v", cfg.block_k), ("dout", cfg.block_q)):
        shape, strides = tma.tensor_layout(p, name)
        caches.append(tma.MapCache(tma.map_geometry(shape, strides, p.dtype, rows), encoder=encoder))
    mq, mk, mv, mdo = caches

    def bind(slots):
        q, k, v, dout, *rest = slots
        return (mq.get(address(q)), mk.get(address(k)), mv.get(address(v)), mdo.get(address(dout)), *rest)

    bind.caches = tuple(caches)
    # variable-length batches: the offsets (the maps cover the packed rows as one batch); then the
    # slopes, then a user modification's aux table, last, as they are
    varlen = ("cu_seqlens_q", "cu_seqlens_k") if getattr(p, "varlen", False) else ()
    return SLOTS + varlen + (("alibi_slopes",) if p.alibi else ()) + (("mod_aux",) if p.mod is not None else ()), bind
