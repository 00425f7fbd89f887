"""attn/mask.cuh: MaskGeometry built from its fields, and Mask applied to fragment tiles.

Visibility (the header's canonical form): query q sees key k iff
    q + offset - window_left <= k <= q + offset + window_right   and   k < seqlen_k
with window sides = kUnbounded (2^30) for "no limit". Mask::apply<LEFT, RIGHT> only checks the
edges it is asked for: LEFT masks k < q + offset - window_left, RIGHT masks k > q + offset +
window_right and k >= seqlen_k (the seqlen tail). apply_transposed<LEFT, RIGHT> does the same on
S^T (rows = keys). Mask<false> (a feature set without a bounded left edge) never checks LEFT.

GPU: for each geometry (bottom-right causal, both seqlen orders; top-left causal; a sliding window
left = L, right = 0; a two-sided window; no mask) and origins (q0, k0) around the diagonal, the
window's left edge and the seqlen_k tail, the masked tile of the header equals NumPy's
where(masked(q, k), fill, s), for all four (LEFT, RIGHT) and in the transposed view; and
key_begin / key_end / query_first / query_last equal their formulas, sentinel included.
CPU: the NumPy table itself agrees with the familiar forms (np.tril for causal, etc.).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.cu.harness import kernel

UNBOUNDED = 1 << 30  # kUnbounded in attn/mask.cuh
MT, NT = 2, 4  # mask_direct_*: acc[2][4][4], a 32 x 32 tile
ROWS, COLS = 16 * MT, 8 * NT
T_ROWS, T_COLS = 16, 8 * NT  # mask_transposed: one m16 tile of S^T (16 keys x 32 queries)

# name: (window_left, window_right, offset, seqlen_q, seqlen_k)
GEOMETRIES = {
    "causal_bottom_right": (UNBOUNDED, 0, 90 - 50, 50, 90),
    "causal_bottom_right_sq_gt_sk": (UNBOUNDED, 0, 50 - 90, 90, 50),  # first rows see nothing
    "causal_top_left": (UNBOUNDED, 0, 0, 50, 90),
    "sliding_window": (20, 0, 90 - 50, 50, 90),
    "sliding_window_square": (13, 0, 0, 70, 70),
    "two_sided_window": (7, 5, 90 - 50, 50, 90),
    "no_mask": (UNBOUNDED, UNBOUNDED, 90 - 50, 50, 90),  # only the seqlen_k tail
}


def masked(q, k, geo, left=True, right=True):
    """Which (q, k) the mask sets to `fill`, with only the LEFT / RIGHT edge checks asked for."""
    wl, wr, off, _sq, sk = (np.int64(v) for v in geo)
    q, k = np.asarray(q, dtype=np.int64), np.asarray(k, dtype=np.int64)
    out = np.zeros(np.broadcast_shapes(q.shape, k.shape), dtype=bool)
    if left:
        out |= k < q + off - wl
    if right:
        out |= (k > q + off + wr) | (k >= sk)
    return out


def visible(q, k, geo):
    return ~masked(q, k, geo)


def origins(geo):
    """(q0, k0) pairs whose 32 x 32 tile straddles the right edge, the left edge or the tail."""
    wl, wr, off, sq, sk = geo
    out = set()
    for q0 in range(0, sq, 16):
        ks = [q0 + off + d for d in (-40, -24, -9, -8, 0, 3, 8, 24)]          # right edge (diagonal)
        ks += [sk + d for d in (-32, -20, -16, -8, 0)]                        # seqlen_k tail
        if wl < UNBOUNDED:
            ks += [q0 + off - wl + d for d in (-24, -16, -5, 0, 8)]           # left edge
        out.update((q0, k0) for k0 in ks if k0 >= 0)
    return sorted(out)


def _tiles(n, rows, cols, seed):
    # Distinct finite values, so any misplaced register shows up.
    rng = np.random.default_rng(seed)
    return (rng.permutation(n * rows * cols).reshape(n, rows, cols) + 1).astype(np.float32) / 7


def _launch_direct(geo, left, right, orig, fill, suffix=""):
    import cupy

    s = _tiles(len(orig), ROWS, COLS, seed=len(orig))
    q0s, k0s = (np.array(v, dtype=np.int32) for v in zip(*orig))
    out = cupy.full(s.shape, np.nan, dtype=cupy.float32)
    fn = kernel("mask", f"mask_direct_{int(left)}{int(right)}{suffix}")
    fn((len(orig),), (32,), (cupy.asarray(s), out, cupy.asarray(q0s), cupy.asarray(k0s),
                             *(np.int32(v) for v in geo), np.float32(fill)))
    return s, q0s, k0s, cupy.asnumpy(out)


@pytest.mark.gpu
@pytest.mark.parametrize("left, right", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_apply_direct(name, left, right):
    geo = GEOMETRIES[name]
    orig = origins(geo)
    s, q0s, k0s, got = _launch_direct(geo, left, right, orig, -np.inf)
    q = q0s[:, None, None] + np.arange(ROWS)[None, :, None]
    k = k0s[:, None, None] + np.arange(COLS)[None, None, :]
    want = np.where(masked(q, k, geo, left, right), np.float32(-np.inf), s)
    for i in range(len(orig)):
        np.testing.assert_array_equal(got[i], want[i], err_msg=f"{name} LEFT={left} RIGHT={right} (q0, k0)={orig[i]}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_apply_direct_without_local_checks_no_left_edge(name):
    # Mask<false>::apply<true, true>: the instances without a bounded left edge compile it out.
    geo = GEOMETRIES[name]
    orig = origins(geo)
    s, q0s, k0s, got = _launch_direct(geo, True, True, orig, -np.inf, suffix="_nolocal")
    q = q0s[:, None, None] + np.arange(ROWS)[None, :, None]
    k = k0s[:, None, None] + np.arange(COLS)[None, None, :]
    np.testing.assert_array_equal(got, np.where(masked(q, k, geo, False, True), np.float32(-np.inf), s))


@pytest.mark.gpu
def test_apply_direct_fill_zero():
    # After the exp (dK/dV kernel's contract) the fill is 0, not -inf.
    geo = GEOMETRIES["two_sided_window"]
    orig = origins(geo)
    s, q0s, k0s, got = _launch_direct(geo, True, True, orig, 0.0)
    q = q0s[:, None, None] + np.arange(ROWS)[None, :, None]
    k = k0s[:, None, None] + np.arange(COLS)[None, None, :]
    np.testing.assert_array_equal(got, np.where(masked(q, k, geo), np.float32(0), s))


@pytest.mark.gpu
@pytest.mark.parametrize("left, right", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_apply_transposed(name, left, right):
    import cupy

    geo = GEOMETRIES[name]
    orig = origins(geo)
    s = _tiles(len(orig), T_ROWS, T_COLS, seed=3 * len(orig))
    q0s, k0s = (np.array(v, dtype=np.int32) for v in zip(*orig))
    out = cupy.full(s.shape, np.nan, dtype=cupy.float32)
    kernel("mask", "mask_transposed")((len(orig),), (32,), (
        cupy.asarray(s), out, cupy.asarray(q0s), cupy.asarray(k0s), *(np.int32(v) for v in geo),
        np.float32(-np.inf), np.int32(left), np.int32(right)))
    got = cupy.asnumpy(out)
    k = k0s[:, None, None] + np.arange(T_ROWS)[None, :, None]  # rows are keys
    q = q0s[:, None, None] + np.arange(T_COLS)[None, None, :]  # cols are queries
    want = np.where(masked(q, k, geo, left, right), np.float32(-np.inf), s)
    for i in range(len(orig)):
        np.testing.assert_array_equal(got[i], want[i], err_msg=f"{name} left={left} right={right} (q0, k0)={orig[i]}")


@pytest.mark.gpu
@pytest.mark.parametrize("geo", list(GEOMETRIES.values()) + [
    (UNBOUNDED, 0, 0, (1 << 28) - 1, (1 << 28) - 1),                    # the documented int range
    (UNBOUNDED, UNBOUNDED, -((1 << 28) - 1), (1 << 28) - 1, 1),
], ids=list(GEOMETRIES) + ["huge_causal", "huge_no_mask"])
def test_geometry_fields(geo):
    import cupy

    wl, wr, off, sq, sk = geo
    idx = np.unique(np.clip(np.r_[np.arange(0, 130), [sq - 1, sk - 1, max(sq, sk) - 1]], 0, None)).astype(np.int32)
    out = cupy.full(4 * len(idx), -7, dtype=cupy.int32)
    kernel("mask", "geometry_fields")(((len(idx) + 127) // 128,), (128,), (
        cupy.asarray(idx), out, np.int32(len(idx)), *(np.int32(v) for v in geo)))
    got = cupy.asnumpy(out).reshape(-1, 4).astype(np.int64)
    i = idx.astype(np.int64)
    np.testing.assert_array_equal(got[:, 0], i + off - wl, err_msg="key_begin")
    np.testing.assert_array_equal(got[:, 1], np.minimum(sk, i + off + wr + 1), err_msg="key_end")
    np.testing.assert_array_equal(got[:, 2], i - off - wr, err_msg="query_first")
    np.testing.assert_array_equal(got[:, 3], i - off + wl, err_msg="query_last")


# --------------------------------------------------------------------------------------- CPU

def test_visibility_table_is_the_familiar_masks():
    def table(name):
        _, _, _, sq, sk = geo = GEOMETRIES[name]
        return visible(np.arange(sq)[:, None], np.arange(sk)[None, :], geo)

    np.testing.assert_array_equal(table("causal_bottom_right"), np.tril(np.ones((50, 90), bool), 90 - 50))
    np.testing.assert_array_equal(table("causal_bottom_right_sq_gt_sk"), np.tril(np.ones((90, 50), bool), 50 - 90))
    np.testing.assert_array_equal(table("causal_top_left"), np.tril(np.ones((50, 90), bool)))
    np.testing.assert_array_equal(table("no_mask"), np.ones((50, 90), bool))
    win = table("sliding_window")  # the 21 keys q + 40 - 20 .. q + 40
    np.testing.assert_array_equal(win.sum(axis=1), np.full(50, 21))
    np.testing.assert_array_equal(win, np.tril(np.ones((50, 90), bool), 40) & ~np.tril(np.ones((50, 90), bool), 40 - 21))
    two = table("two_sided_window")  # keys q + 33 .. q + 45, clipped at 90
    np.testing.assert_array_equal(two.sum(axis=1), np.minimum(13, 90 - (np.arange(50) + 33)))


def test_edges_split_the_mask():
    # LEFT and RIGHT together are the whole mask; either alone is a subset (what BlockRange relies on).
    for geo in GEOMETRIES.values():
        q, k = np.arange(geo[3])[:, None], np.arange(-8, geo[4] + 8)[None, :]
        both = masked(q, k, geo)
        np.testing.assert_array_equal(both, masked(q, k, geo, True, False) | masked(q, k, geo, False, True))
        assert not masked(q, k, geo, False, False).any()


def test_origins_reach_every_kind_of_tile():
    # Every geometry's origins include tiles fully visible, fully masked and mixed; the windows'
    # include tiles cut by the left edge only.
    for name, geo in GEOMETRIES.items():
        kinds = set()
        for q0, k0 in origins(geo):
            q, k = q0 + np.arange(ROWS)[:, None], k0 + np.arange(COLS)[None, :]
            m, ml = masked(q, k, geo), masked(q, k, geo, True, False)
            kinds.add("all" if m.all() else "none" if not m.any() else "mixed")
            if ml.any() and not masked(q, k, geo, False, True).any():
                kinds.add("left_only")
        assert {"all", "mixed"} <= kinds, (name, kinds)
        if geo[0] < UNBOUNDED:
            assert "left_only" in kinds, name
