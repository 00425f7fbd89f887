"""Python twin of the Hopper deterministic backward's dQ order (kernels_cu/sm90/det_order.cuh's
det_rank, sm90/bwd.cuh's block_at walk) and of the host's choice between its two orders
(cuflash/_backward.py det_rotation). CPU only.

  * every dQ block's key blocks get the ranks 0 .. count - 1, once each, in both orders, for causal
    (bottom-right and top-left), right-bounded windows and unmasked calls of any seqlens: the fp32
    additions into each dQ block happen in one order whatever the timing (bitwise reproducible);
  * in the rotated order each key block's predecessor reaches the dQ block at an earlier step (at
    the same one only where several key blocks begin at the same query block, a causal call with
    seqlen_k > seqlen_q); in the staircase order, unmasked, always at the same one;
  * a discrete-event model of the turns (a CTA per key block, in-order dispatch onto a given number
    of SMs, a step's compute, its staging, the turn wait and the reduction's round trip) finishes
    in both orders where the host picks them, and shows why the host keeps the rotated order to
    heads whose key blocks all fit on the GPU: with fewer SMs than a head's key blocks it can
    deadlock, and why the unmasked rotation strides (a hand-over longer than a step otherwise
    waits). The model times only the turns: it puts both orders near the ideal, where the H200
    measured the head-grouped staircase 0.78-0.83x the atomic mode and the rotated order 0.83-0.93x
    (the staircase's grid re-read Q and dO from DRAM: docs/perf-notes.md).
If a formula changes in the header, change it here.
"""
from __future__ import annotations

import heapq
import types

import numpy as np
import pytest

from cuflash._backward import det_rotation
from tests.test_block_range_twin import UNBOUNDED, Geometry, key_blocks, query_blocks

BR, BC = 64, 128  # the sm90 backward's tiles (query rows per step, keys per CTA)


def m_blocks(geo, br=BR):
    return -(-geo.seqlen_q // br)


def n_blocks(geo, bc=BC):
    return -(-geo.seqlen_k // bc)


def det_rank(geo, n, m, rotate, br=BR, bc=BC):
    """det_order.cuh's det_rank (LOCAL false: the host never rotates a left-bounded window);
    rotate: BwdParams.det_rotate (0 the staircase, else the rotation's stride)."""
    begin, end, _, _ = key_blocks(geo, br, bc, m * br, local=False)
    if not rotate:
        return n - begin
    if geo.right < UNBOUNDED:
        return end - 1 - n
    nb = n_blocks(geo, bc)
    a = min(m // rotate, nb - 1)
    return a - n if n <= a else a + nb - n


def walk(geo, n, rotate, br=BR, bc=BC):
    """bwd.cuh's block_at over a key block's steps: the query blocks in the order it visits them."""
    mb = m_blocks(geo, br)
    b, e, _, _ = query_blocks(geo, br, bc, n, mb, local=False)
    blocks = list(range(b, e))
    if rotate and geo.right < UNBOUNDED:
        return blocks
    if not rotate:
        return blocks[::-1]
    k, start = len(blocks), rotate * n
    assert start < k  # the host's stride: m_blocks // n_blocks
    return [blocks[it + start - k if it + start >= k else it + start] for it in range(k)]


def det_stride(geo, det_rotate):
    """det_order.cuh's det_stride: the CTA's order, 0 the staircase, else the rotation's stride."""
    if not det_rotate:
        return 0
    if geo.right < UNBOUNDED:
        return 1
    return m_blocks(geo) // n_blocks(geo)


def host_rotates(geo, sm_count, varlen=False):
    """The stride a dense call's CTAs take: det_rotation's BwdParams.det_rotate through det_stride
    (0: the staircase)."""
    p = types.SimpleNamespace(window_left=geo.left, window_right=geo.right, varlen=varlen)
    return det_stride(geo, det_rotation(p, n_blocks(geo), m_blocks(geo), sm_count))


def _geometries(count, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        nq, nk = (int(x) for x in rng.integers(1, 3000, 2))
        kind = rng.integers(4)
        if kind == 0:
            out.append(Geometry.from_causal(False, nq, nk))
        elif kind == 1:
            out.append(Geometry.from_causal(True, nq, nk))
        elif kind == 2:  # top-left causal
            out.append(Geometry(UNBOUNDED, 0, 0, nq, nk))
        else:  # a right-bounded window (no left edge), bottom-right
            out.append(Geometry(UNBOUNDED, int(rng.integers(0, 300)), nk - nq, nq, nk))
    # the benchmark's shapes
    for n in (512, 2048, 8192):
        out += [Geometry.from_causal(False, n, n), Geometry.from_causal(True, n, n)]
    return out


def _visits(geo, rotate):
    """{m: [(n, step, rank)]} over every (key block, step) the kernel runs."""
    out = {}
    for n in range(n_blocks(geo)):
        for step, m in enumerate(walk(geo, n, rotate)):
            out.setdefault(m, []).append((n, step, det_rank(geo, n, m, rotate)))
    return out


@pytest.mark.parametrize("rotated", [False, True])
def test_every_dq_block_takes_its_key_blocks_in_one_order(rotated):
    for geo in _geometries(300, seed=1):
        rotate = host_rotates(geo, sm_count=10**6) if rotated else 0
        if rotated and not rotate:
            continue
        for m, vs in _visits(geo, rotate).items():
            # the key blocks that visit m are those key_blocks says see it
            begin, end, _, _ = key_blocks(geo, BR, BC, m * BR, local=False)
            assert sorted(n for n, _, _ in vs) == list(range(begin, end)), (vars(geo), m)
            assert sorted(r for _, _, r in vs) == list(range(len(vs))), (vars(geo), m, vs)


def test_the_rotated_order_is_the_order_of_arrival():
    """Rotated, each key block's predecessor in a dQ block's order reached it at an earlier step
    (the stride's steps or more before, unmasked: it had that long to finish its reduction); in the
    staircase order every key block reaches a dQ block at the same step as its predecessor (it
    waits the round trip)."""
    strides = set()
    for geo in _geometries(300, seed=2):
        stride = host_rotates(geo, sm_count=10**6)
        if not stride:
            continue
        for rotate in (0, stride):
            for m, vs in _visits(geo, rotate).items():
                steps = [s for _, s, _ in sorted(vs, key=lambda v: v[2])]
                gaps = np.diff(steps)
                if rotate:
                    # unmasked: the stride apart or more; right-bounded: never later, a step or more
                    # apart where the key blocks' first query blocks differ (square causal: 2 apart),
                    # at the same step where several begin at the same block (seqlen_k > seqlen_q: a
                    # staircase there)
                    if geo.right == UNBOUNDED:
                        strides.add(stride)
                        assert (gaps >= stride).all(), (vars(geo), m, steps)
                    strict = geo.right == 0 and geo.offset <= 0
                    assert (gaps >= (1 if strict else 0)).all(), (vars(geo), m, steps)
                elif geo.right == UNBOUNDED:
                    assert (gaps == 0).all(), (vars(geo), m, steps)


def test_varlen_sequences_take_their_own_order():
    """Varlen: the host allows the rotation by the longest sequence's key blocks only; each CTA takes
    its sequence's stride, the staircase where the sequence has more key blocks than query blocks
    (unmasked): ranks stay a permutation per dQ block in every sequence, whichever order it takes."""
    p = types.SimpleNamespace(window_left=UNBOUNDED, window_right=UNBOUNDED, varlen=True)
    assert det_rotation(p, 32, 16, 132) == 1  # a dense call of this shape keeps the head groups (0)
    assert det_rotation(types.SimpleNamespace(window_left=UNBOUNDED, window_right=UNBOUNDED, varlen=False),
                        32, 16, 132) == 0
    assert det_rotation(p, 200, 400, 132) == 0  # the longest sequence's key blocks do not fit
    for nq, nk in ((1000, 4000), (4000, 1000), (17, 113), (113, 17), (1, 300), (640, 640)):
        for causal in (False, True):
            geo = Geometry.from_causal(causal, nq, nk)
            r = det_stride(geo, 1)
            assert r == (1 if causal else m_blocks(geo) // n_blocks(geo))
            for m, vs in _visits(geo, r).items():
                assert sorted(rk for _, _, rk in vs) == list(range(len(vs))), (nq, nk, causal, m)


def test_the_host_rotates_only_where_a_heads_key_blocks_fit():
    geo = Geometry.from_causal(False, 8192, 8192)  # 64 key blocks, 128 query blocks
    assert host_rotates(geo, 132) and not host_rotates(geo, 63)
    assert host_rotates(Geometry.from_causal(True, 8192, 8192), 64)
    assert not host_rotates(Geometry.from_causal(False, 1024, 4096), 132)  # 32 key blocks, 16 query blocks
    assert host_rotates(Geometry.from_causal(True, 1024, 4096), 132)  # right-bounded: any ratio
    assert not host_rotates(Geometry(100, 0, 0, 2048, 2048), 132)  # a left edge: the LOCAL instances' staircase


# ----------------------------------------------------------------------------- the turns, timed


def staircase_order(geo, heads, sm_count):
    """schedule_blocks_grouped's CTA order: heads fastest within groups of ordered_group_heads."""
    nb, mb = n_blocks(geo), m_blocks(geo)
    group = max(1, min(heads, -(-sm_count // max(1, mb // 16))))
    out = []
    for g0 in range(0, heads, group):
        hs = range(g0, min(heads, g0 + group))
        out += [(h, n) for n in range(nb) for h in hs]
    return out


def simulate(geo, heads, sm_count, rotate, compute=10, trip=6, order=None):
    """Makespan of one launch (heads x n_blocks CTAs, key blocks fastest when rotated, else heads
    fastest within groups as schedule_blocks_grouped), or None on deadlock. A CTA's step: its
    consumers compute the block (`compute` ticks) and stage it once the previous staging was
    issued; the store warp waits for the block's turn counter to equal its rank, issues the
    reduction, and the counter moves on `trip` ticks later (when it is complete in global memory).
    CTAs start in index order as SMs free up (an SM is freed when its CTA's last reduction is done)."""
    nb = n_blocks(geo)
    walks = [walk(geo, n, rotate) for n in range(nb)]
    ranks = [[det_rank(geo, n, m, rotate) for m in walks[n]] for n in range(nb)]
    if order is None:
        order = [(h, n) for h in range(heads) for n in range(nb)] if rotate else staircase_order(geo, heads, sm_count)
    sem = {}  # (head, m) -> completed reductions
    waiting = {}  # (head, m) -> [(rank, cta)]
    events = []  # (time, seq, kind, payload)
    seq = 0
    state = {}

    def push(t, kind, payload):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    def start(i, t):
        h, n = order[i]
        state[i] = {"step": 0, "staged": t, "issued": t, "left": len(walks[n])}
        if not walks[n]:
            push(t, "done", i)
            return
        push(t + compute, "ready", i)

    next_cta = 0
    for _ in range(min(sm_count, len(order))):
        start(next_cta, 0)
        next_cta += 1
    done, t = 0, 0
    while events:
        t, _, kind, i = heapq.heappop(events)
        if kind == "done":
            done += 1
            if next_cta < len(order):
                start(next_cta, t)
                next_cta += 1
            continue
        if kind == "complete":
            i, key = i
            sem[key] = sem.get(key, 0) + 1
            for r, j in list(waiting.get(key, [])):
                if r == sem[key]:
                    waiting[key].remove((r, j))
                    push(t, "issue", j)
            st = state[i]
            st["left"] -= 1
            if st["left"] == 0:
                push(t, "done", i)
            continue
        h, n = order[i]
        st = state[i]
        s = st["step"]
        key = (h, walks[n][s])
        if kind == "ready":  # block s computed; staged once block s - 1's staging was issued
            st["staged"] = max(t, st["issued"])
            if sem.get(key, 0) == ranks[n][s]:
                push(st["staged"], "issue", i)
            else:
                waiting.setdefault(key, []).append((ranks[n][s], i))
            if s + 1 < len(walks[n]):
                pass  # the next block's compute starts once this one is staged (below, at issue)
            continue
        if kind == "issue":
            t = max(t, st["staged"])
            st["issued"] = t
            push(t + trip, "complete", (i, key))
            st["step"] = s + 1
            if s + 1 < len(walks[n]):
                push(max(t, st["staged"]) + compute, "ready", i)
    return t if done == len(order) else None


@pytest.mark.parametrize("causal", [False, True])
def test_both_orders_finish_near_the_ideal(causal):
    """The benchmark's shapes (16k tokens, 16 heads, d128) on 132 SMs: both orders finish; the model
    puts the staircase (head groups) 3-8% over the work's ideal and the rotated order no better
    unmasked and 4-7% worse causal (whole heads per wave balance worse than the heavy key blocks of
    many heads first). The H200 measured the staircase 12-22% under the atomic mode and the
    rotated order 7-17%: what separates them is the memory traffic of the staircase's head groups,
    which the model does not time."""
    for n in (1024, 2048):
        geo = Geometry.from_causal(causal, n, n)
        heads = 16384 // n * 16
        stride = host_rotates(geo, 132)
        assert stride == (1 if causal else 2)
        ideal = sum(len(walk(geo, k, 0)) for k in range(n_blocks(geo))) * heads * 10 / 132
        stair = simulate(geo, heads, 132, rotate=0)
        rot = simulate(geo, heads, 132, rotate=stride)
        assert stair is not None and rot is not None, n
        assert stair < 1.08 * ideal, (n, causal, stair, ideal)
        assert rot < 1.08 * ideal if not causal else rot < 1.15 * ideal, (n, causal, rot, ideal)


def test_rotated_order_can_deadlock_where_a_heads_key_blocks_do_not_fit():
    """Why det_rotation wants n_blocks <= the SM count: with 8 SMs for 16 key blocks of a head, the
    first 8 wait for turns only key blocks 8-15 can pass, and no SM frees up for them."""
    geo = Geometry.from_causal(False, 2048, 2048)
    for stride in (1, 2):
        assert simulate(geo, heads=2, sm_count=8, rotate=stride) is None
        assert simulate(geo, heads=2, sm_count=16, rotate=stride) is not None
    assert simulate(geo, heads=2, sm_count=8, rotate=0) is not None  # the staircase waits only downwards


def test_the_stride_hides_a_hand_over_longer_than_a_step():
    """Unmasked, a stride of 1 brings a dQ block's key blocks a step apart: where the turn's hand-over
    (the reduction's completion, the release, the next store warp's acquire) takes longer than a
    step's compute (head_dim 64 on the H200), each waits; the host's stride (2 for square calls with
    64-row query blocks and 128-key blocks) gives it two steps."""
    geo = Geometry.from_causal(False, 2048, 2048)
    heads = 16384 // 2048 * 16
    one = simulate(geo, heads, 132, rotate=1, compute=10, trip=14)
    two = simulate(geo, heads, 132, rotate=2, compute=10, trip=14)
    assert two < 0.9 * one, (one, two)
