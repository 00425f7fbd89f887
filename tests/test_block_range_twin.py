"""NumPy twin of kernels_cu/attn/mask.cuh (MaskGeometry, the window predicate) and
kernels_cu/attn/block_range.cuh (key_blocks, query_blocks, live_query_blocks, with their LOCAL
template flag as `local`: by default what the geometry needs). CPU only.

The functions below copy the device formulas line for line, in C integer semantics (`_div` is C's
truncating division, so a negative numerator behaves as on the device), and the tests enumerate
random (seqlen_q, seqlen_k, window, offset, tile sizes) against the element-level definition:

  * every block pair with a visible element is visited (visited ⊇ needed), and a skipped pair has
    none, counting the virtual rows/keys that pad the last tiles (so no block is visited needlessly
    either, except through that padding);
  * an unmasked block has every (real row, real key) element visible and no seqlen_k tail;
  * masked blocks split into head (left edge) and tail (right edge, seqlen tail): a block outside
    the head needs no left-edge mask, one outside the tail no right-edge mask (Mask::apply<LEFT, RIGHT>);
  * key_blocks and query_blocks enumerate the same pairs (the v1 kernel uses both sides);
  * live_query_blocks is exactly the query blocks with a non-empty key range;
  * every intermediate stays inside int32 for seqlens and |offset| < 2^28 with the sentinel.
If a formula changes in the header, change it here.
"""

import numpy as np
import pytest

UNBOUNDED = 1 << 30  # kUnbounded
INT32 = (-(2**31), 2**31 - 1)


def _div(a, b):
    """C integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _i32(*xs):
    for x in xs:
        assert INT32[0] <= x <= INT32[1], x
    return xs[0] if len(xs) == 1 else xs


class Geometry:
    """MaskGeometry."""

    def __init__(self, left, right, offset, seqlen_q, seqlen_k):
        self.left, self.right, self.offset, self.seqlen_q, self.seqlen_k = left, right, offset, seqlen_q, seqlen_k

    @classmethod
    def from_causal(cls, causal, seqlen_q, seqlen_k):
        return cls(UNBOUNDED, 0 if causal else UNBOUNDED, seqlen_k - seqlen_q, seqlen_q, seqlen_k)

    def key_begin(self, q):
        return _i32(q + self.offset - self.left)

    def key_end(self, q):
        return min(self.seqlen_k, _i32(q + self.offset + self.right + 1))

    def query_first(self, k):
        return _i32(k - self.offset - self.right)

    def query_last(self, k):
        return _i32(k - self.offset + self.left)

    def visible(self, q, k):
        """Element-level definition (NumPy arrays q, k broadcast): the one the device must match."""
        q, k = np.asarray(q, np.int64), np.asarray(k, np.int64)
        return (k >= q + self.offset - self.left) & (k <= q + self.offset + self.right) & (k < self.seqlen_k)


def _local(geo, local):
    """The template's LOCAL, defaulting to what the geometry needs; LOCAL = false is only for an
    unbounded left edge (MaskGeometry::of<V> never gives anything else to such instances)."""
    if local is None:
        return geo.left != UNBOUNDED
    assert local or geo.left == UNBOUNDED
    return local


def key_blocks(geo, br, bc, r0, local=None):
    ke_first, ke_last = geo.key_end(r0), geo.key_end(r0 + br - 1)
    end = 0 if ke_last <= 0 else _div(_i32(ke_last + bc - 1), bc)
    if _local(geo, local):
        kb_first, kb_last = geo.key_begin(r0), geo.key_begin(r0 + br - 1)
        begin = min(end, 0 if kb_first <= 0 else _div(kb_first, bc))
        unmasked_begin = 0 if kb_last <= 0 else _div(_i32(kb_last + bc - 1), bc)
    else:
        begin = unmasked_begin = 0
    unmasked_end = 0 if ke_first <= 0 else _div(ke_first, bc)
    return begin, end, unmasked_begin, unmasked_end


def query_blocks(geo, br, bc, n_block, m_blocks, local=None):
    c0 = n_block * bc
    qf_first, qf_last = geo.query_first(c0), geo.query_first(c0 + bc - 1)
    if _local(geo, local):
        ql_first, ql_last = geo.query_last(c0), geo.query_last(c0 + bc - 1)
        end = 0 if ql_last < 0 else min(m_blocks, _div(ql_last, br) + 1)
        unmasked_end = 0 if ql_first < 0 else _div(_i32(ql_first + 1), br)
    else:
        end = unmasked_end = m_blocks
    begin = min(end, 0 if qf_first <= 0 else _div(qf_first, br))
    unmasked_begin = m_blocks if c0 + bc > geo.seqlen_k else 0 if qf_last <= 0 else _div(_i32(qf_last + br - 1), br)
    return begin, end, unmasked_begin, unmasked_end


def live_query_blocks(geo, br, bc, m_blocks, local=None):
    qf = geo.query_first(0)
    if _local(geo, local):
        ql = geo.query_last(_div(geo.seqlen_k + bc - 1, bc) * bc - 1)
        end = 0 if ql < 0 else min(m_blocks, _div(ql, br) + 1)
    else:
        end = m_blocks
    begin = min(end, 0 if qf <= 0 else _div(qf, br))
    return begin, end


# ----------------------------------------------------------------------------- element-level oracle


def _cases(n, seed):
    rng = np.random.default_rng(seed)
    tiles = [(16, 16), (64, 64), (128, 64), (64, 128), (128, 96), (64, 32), (16, 48)]
    for _ in range(n):
        nq, nk = (int(x) for x in rng.integers(1, 400, 2))
        br, bc = tiles[rng.integers(len(tiles))]
        kind = rng.integers(5)
        if kind == 0:
            geo = Geometry.from_causal(False, nq, nk)
        elif kind == 1:
            geo = Geometry.from_causal(True, nq, nk)
        elif kind == 2:  # top-left causal
            geo = Geometry(UNBOUNDED, 0, 0, nq, nk)
        else:  # sliding window (either side may be unbounded), any offset
            left = UNBOUNDED if rng.random() < 0.2 else int(rng.integers(0, 300))
            right = UNBOUNDED if rng.random() < 0.2 else int(rng.integers(0, 300))
            if rng.random() < 0.3:  # one-sided negative side, window still non-empty
                if rng.random() < 0.5 and right != UNBOUNDED:
                    left = -int(rng.integers(0, right + 1))
                elif left != UNBOUNDED:
                    right = -int(rng.integers(0, left + 1))
            off = int(rng.integers(-450, 450)) if kind == 3 else nk - nq
            geo = Geometry(left, right, off, nq, nk)
        yield geo, br, bc


def _check(geo, br, bc):
    nq, nk = geo.seqlen_q, geo.seqlen_k
    mb, nb = -(-nq // br), -(-nk // bc)
    # element visibility over the padded grid: rows/keys past the seqlens are "virtual"
    q = np.arange(mb * br)[:, None]
    k = np.arange(nb * bc)[None, :]
    win = (k >= q + geo.offset - geo.left) & (k <= q + geo.offset + geo.right)  # window only, virtual incl.
    vis = win & (k < nk)                                                          # device predicate
    real = (q < nq) & (k < nk)
    pairs_k = set()
    for i in range(mb):
        b, e, ub, ue = key_blocks(geo, br, bc, i * br)
        assert 0 <= b <= e <= nb
        visited = set(range(b, e))
        pairs_k |= {(i, j) for j in visited}
        for j in range(nb):
            blk = (slice(i * br, i * br + br), slice(j * bc, j * bc + bc))
            if (vis[blk] & real[blk]).any():
                assert j in visited, ("needed block skipped", i, j)
            if j not in visited:
                assert not win[blk].any(), ("skipped block with a window element (virtual incl.)", i, j)
            if j in visited and not (j < ub or j >= ue):
                assert (j + 1) * bc <= nk and vis[blk].all(), ("unmasked block needs the mask", i, j)
            if j in visited and not j < ub:  # no left-edge mask applied
                assert (k[:, blk[1]] >= q[blk[0]] + geo.offset - geo.left).all(), ("head", i, j)
            if j in visited and not j >= ue:  # no right-edge / tail mask applied
                assert ((k[:, blk[1]] <= q[blk[0]] + geo.offset + geo.right) & (k[:, blk[1]] < nk)).all(), ("tail", i, j)
    pairs_q = set()
    for j in range(nb):
        b, e, ub, ue = query_blocks(geo, br, bc, j, mb)
        assert 0 <= b <= e <= mb
        pairs_q |= {(i, j) for i in range(b, e)}
        for i in range(b, e):
            blk = (slice(i * br, i * br + br), slice(j * bc, j * bc + bc))
            if not (i < ub or i >= ue):
                assert (j + 1) * bc <= nk and vis[blk].all(), ("unmasked query block needs the mask", i, j)
            if not i < ub:  # transposed: no right-edge / tail mask applied
                assert ((k[:, blk[1]] <= q[blk[0]] + geo.offset + geo.right) & (k[:, blk[1]] < nk)).all(), ("T tail", i, j)
            if not i >= ue:  # transposed: no left-edge mask applied
                assert (k[:, blk[1]] >= q[blk[0]] + geo.offset - geo.left).all(), ("T head", i, j)
    assert pairs_k == pairs_q, "key_blocks and query_blocks disagree"
    lb, le = live_query_blocks(geo, br, bc, mb)
    live = {i for i in range(mb) if key_blocks(geo, br, bc, i * br)[0] < key_blocks(geo, br, bc, i * br)[1]}
    assert live == set(range(lb, le)), (live, lb, le)


@pytest.mark.parametrize("seed", range(8))
def test_block_ranges_match_the_element_mask(seed):
    for geo, br, bc in _cases(150, seed):
        _check(geo, br, bc)


@pytest.mark.parametrize("nq,nk", [(1, 1), (113, 203), (203, 113), (1000, 1000), (64, 300), (300, 64), (1, 239), (239, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_today_geometry_matches_the_former_causal_formulas(nq, nk, causal):
    """from_causal reproduces the kernels' former (causal, seqlen_q, seqlen_k) block ranges exactly."""
    off = nk - nq
    for br, bc in [(64, 64), (128, 64), (128, 128), (128, 96), (64, 128)]:
        geo = Geometry.from_causal(causal, nq, nk)
        _check(geo, br, bc)
        mb, nb = -(-nq // br), -(-nk // bc)
        for i in range(mb):  # forward / dQ: n_end, n_full
            r0 = i * br
            n_end, n_full = nb, nk // bc
            if causal:
                last_key = r0 + br - 1 + off
                n_end = min(n_end, 0 if last_key < 0 else last_key // bc + 1)
                first_row_keys = r0 + off + 1
                n_full = min(n_full, 0 if first_row_keys < 0 else first_row_keys // bc)
            b, e, ub, ue = key_blocks(geo, br, bc, r0)
            assert (b, e, ub) == (0, n_end, 0) and ue == n_full
        for j in range(nb):  # dK/dV: m_begin, need_mask
            c0 = j * bc
            m_begin = 0
            if causal:
                first_row = c0 - off
                m_begin = 0 if first_row <= 0 else min(mb, first_row // br)
            b, e, ub, ue = query_blocks(geo, br, bc, j, mb)
            assert (b, e) == (m_begin, mb) or (b == e == mb == m_begin)
            for i in range(b, e):
                need = c0 + bc > nk or (causal and i * br + off < c0 + bc - 1)
                assert (i < ub or i >= ue) == need


def test_without_local_the_ranges_are_the_general_ones():
    """LOCAL = false (instances without a bounded left edge) only replaces the left-edge bounds by
    the constants the general formulas give for window_left = kUnbounded: same visited blocks, same
    masked ones (unmasked_end of query_blocks may differ past the last query block only)."""
    for seed in range(4):
        for geo, br, bc in _cases(150, 100 + seed):
            if geo.left != UNBOUNDED:
                geo = Geometry(UNBOUNDED, geo.right, geo.offset, geo.seqlen_q, geo.seqlen_k)
            mb, nb = -(-geo.seqlen_q // br), -(-geo.seqlen_k // bc)
            for i in range(mb):
                assert key_blocks(geo, br, bc, i * br, True) == key_blocks(geo, br, bc, i * br, False)
            for j in range(nb):
                b, e, ub, ue = query_blocks(geo, br, bc, j, mb, True)
                assert (b, e, ub, min(ue, mb)) == query_blocks(geo, br, bc, j, mb, False)
            assert live_query_blocks(geo, br, bc, mb, True) == live_query_blocks(geo, br, bc, mb, False)


def test_sentinel_arithmetic_stays_in_int32():
    """Extreme seqlens and offsets (< 2^28) with unbounded sides: no intermediate overflows."""
    big = (1 << 28) - 1
    for nq, nk, off in [(big, big, 0), (big, 1, 1 - big), (1, big, big - 1), (big, big, big), (big, big, -big)]:
        for left, right in [(UNBOUNDED, UNBOUNDED), (UNBOUNDED, 0), (0, UNBOUNDED), (5, 7)]:
            geo = Geometry(left, right, off, nq, nk)
            for r0 in (0, (nq // 128) * 128):
                key_blocks(geo, 128, 128, r0, True)
            mb = -(-nq // 128)
            for j in (0, (nk - 1) // 128):
                query_blocks(geo, 128, 128, j, mb, True)
            live_query_blocks(geo, 128, 128, mb, True)
