"""Ring attention's schedule and loops, independent of the array library and the transport (issue 15).

Each of `world` ranks holds a shard of the sequence: its queries and its keys/values. Key/value
blocks travel around the ring (rank r receives from r - 1 and sends to r + 1); at step s rank r
holds the block of rank (r - s) mod world, attends its own queries to it, and merges the partial
result by log-sum-exp (cuflash.merge_attention). The backward recomputes each step with the
merged out and lse (FlashAttention's backward only needs them, not the per-step ones); dK/dV
accumulators travel with their block and take one extra hop home at the end.

Causal attention is load-balanced by the zigzag layout: the sequence is cut into 2*world chunks
and rank r holds chunks r and 2*world - 1 - r (its "front" and "back" halves). Then every step is
one of three unmasked-or-diagonal shapes, with no mask offsets needed:

    src == r   "diagonal":      the local causal attention (front and back halves in order: the
                                bottom-right causal mask of the concatenation is exactly right)
    src <  r   "front_keys":    every local query sees the block's front half, none of its back
    src >  r   "back_queries":  the local back half sees the whole block, the front half nothing

and every rank does the same work (one diagonal, then half a block per step). Without a causal
mask every step is "all".

The loops take three callables, so that the same code runs under torch.distributed
(cuflash/distributed.py) and in the NumPy simulation of the CPU tests:
    attend(q, k, v, causal) -> (out, lse)                  (lse: (batch, heads, seqlen_q))
    attend_backward(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)
    exchange(tensors) -> handle; handle.wait() -> the tensors the previous rank sent
and `ops`, the array library's few primitives (RingOps).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .merge import merge_attention

DIAGONAL, FRONT_KEYS, BACK_QUERIES, ALL = "diagonal", "front_keys", "back_queries", "all"


def step_source(rank: int, step: int, world: int) -> int:
    """The rank whose key/value block rank `rank` holds at step `step`."""
    return (rank - step) % world


def step_kind(rank: int, src: int, causal: bool) -> str:
    """Which part of the local queries and the block's keys a step attends (zigzag layout)."""
    if not causal:
        return ALL
    if src == rank:
        return DIAGONAL
    return FRONT_KEYS if src < rank else BACK_QUERIES


def zigzag_chunks(rank: int, world: int) -> tuple[int, int]:
    """The two chunk indices (of 2 * world) rank `rank` holds."""
    return rank, 2 * world - 1 - rank


def check_zigzag(seqlen: int, world: int, name: str = "seqlen") -> int:
    """Chunk length of the zigzag layout; the sequence must split into 2 * world equal chunks."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    if seqlen % (2 * world):
        raise ValueError(f"{name} {seqlen} must be a multiple of 2 * world = {2 * world} for the zigzag layout")
    return seqlen // (2 * world)


@dataclasses.dataclass(frozen=True)
class RingOps:
    """The array primitives the loops need: slicing along the sequence axis (1 for q/k/v/out, 2 for
    lse) is plain indexing; these are the rest."""

    zeros_acc: Callable  # zeros_acc(like) -> zeros of like's shape in the accumulator dtype (float32), on its device
    to_acc: Callable     # to_acc(x) -> x in the accumulator dtype
    cast: Callable       # cast(x, like) -> x in like's dtype
    concat: Callable     # concat(list, axis)
    contiguous: Callable  # contiguous(x) -> a C-contiguous copy where x is not


def zigzag_shard(x, rank: int, world: int, ops: RingOps, axis: int = 1):
    """Rank `rank`'s shard of a full sequence array: chunks r and 2*world-1-r along `axis`."""
    c = check_zigzag(x.shape[axis], world, "the sequence axis")
    a, b = zigzag_chunks(rank, world)
    idx = [slice(None)] * x.ndim

    def chunk(i):
        idx[axis] = slice(i * c, (i + 1) * c)
        return x[tuple(idx)]

    return ops.concat([chunk(a), chunk(b)], axis)


def zigzag_unshard(shards: list, ops: RingOps, axis: int = 1):
    """The full sequence array from every rank's shard (inverse of zigzag_shard)."""
    world = len(shards)
    c = check_zigzag(shards[0].shape[axis], 1, "a shard's sequence axis")  # a shard is two chunks
    idx = [slice(None)] * shards[0].ndim
    chunks = [None] * (2 * world)
    for r, s in enumerate(shards):
        for half, i in enumerate(zigzag_chunks(r, world)):
            idx[axis] = slice(half * c, (half + 1) * c)
            chunks[i] = s[tuple(idx)]
    return ops.concat(chunks, axis)


def _merge_rows(acc_out, acc_lse, out, lse, rows: slice):
    """Merge a partial result for query rows `rows` into the running (acc_out, acc_lse), in the accumulator dtype."""
    o, l = merge_attention([acc_out[:, rows], out], [acc_lse[:, :, rows], lse], out_dtype=acc_out.dtype)
    acc_out[:, rows] = o
    acc_lse[:, :, rows] = l


def ring_forward(q, k, v, *, rank: int, world: int, causal: bool, attend: Callable, exchange: Callable,
                 ops: RingOps):
    """(out, lse) of this rank's queries over the whole ring's keys. q, k, v: this rank's shard
    (batch, seqlen, heads, head_dim), zigzag-laid-out when causal. out in q's dtype, lse float32."""
    c = q.shape[1] // 2
    acc_out = acc_lse = None
    kv = (k, v)
    for s in range(world):
        pending = exchange(list(kv)) if s < world - 1 else None  # the next block moves while this one is used
        src = step_source(rank, s, world)
        kind = step_kind(rank, src, causal)
        bk, bv = kv
        if kind in (DIAGONAL, ALL):
            out, lse = attend(q, bk, bv, kind == DIAGONAL)
            rows = slice(None)
        elif kind == FRONT_KEYS:
            out, lse = attend(q, bk[:, :c], bv[:, :c], False)
            rows = slice(None)
        else:  # BACK_QUERIES
            out, lse = attend(q[:, c:], bk, bv, False)
            rows = slice(c, None)
        if acc_out is None:  # step 0 covers every row (diagonal or all)
            acc_out, acc_lse = ops.to_acc(out), ops.to_acc(lse)
        else:
            _merge_rows(acc_out, acc_lse, out, lse, rows)
        if pending is not None:
            kv = tuple(pending.wait())
    return ops.cast(acc_out, q), acc_lse


def ring_backward(dout, q, k, v, out, lse, *, rank: int, world: int, causal: bool, attend_backward: Callable,
                  exchange: Callable, ops: RingOps):
    """(dq, dk, dv) of this rank's shard: dq of its queries, dk/dv of its own keys/values, summed
    over every rank's queries (the accumulators travel with their block and come home at the end)."""
    c = q.shape[1] // 2
    dq = ops.zeros_acc(q)
    kv = (k, v)
    dkv = (ops.zeros_acc(k), ops.zeros_acc(v))  # the accumulators of the block held at this step
    for s in range(world):
        pending = exchange(list(kv)) if s < world - 1 else None
        src = step_source(rank, s, world)
        kind = step_kind(rank, src, causal)
        bk, bv = kv
        if kind in (DIAGONAL, ALL):
            gq, gk, gv = attend_backward(dout, q, bk, bv, out, lse, kind == DIAGONAL)
            dq += ops.to_acc(gq)
            dkv[0][...] += ops.to_acc(gk)
            dkv[1][...] += ops.to_acc(gv)
        elif kind == FRONT_KEYS:
            gq, gk, gv = attend_backward(dout, q, bk[:, :c], bv[:, :c], out, lse, False)
            dq += ops.to_acc(gq)
            dkv[0][:, :c] += ops.to_acc(gk)
            dkv[1][:, :c] += ops.to_acc(gv)
        else:  # BACK_QUERIES
            gq, gk, gv = attend_backward(dout[:, c:], q[:, c:], bk, bv, out[:, c:], ops.contiguous(lse[:, :, c:]), False)
            dq[:, c:] += ops.to_acc(gq)
            dkv[0][...] += ops.to_acc(gk)
            dkv[1][...] += ops.to_acc(gv)
        # the block's accumulators go where the block goes (after this step's additions)
        moved = exchange(list(dkv))
        if pending is not None:
            kv = tuple(pending.wait())
        dkv = tuple(moved.wait())
    # after `world` hops every accumulator is back with its owner
    return ops.cast(dq, q), ops.cast(dkv[0], k), ops.cast(dkv[1], v)
