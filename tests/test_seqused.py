"""seqused_q / seqused_k without a GPU (cuflash/seqused.py): the three-way split of each sequence
(its offsets, and in float64 that attention over the split is attention over the used rows), the
checks of host lengths, and what is refused before anything runs."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import _interop, reference, seqused, varlen


def test_split_offsets_give_each_sequence_its_used_rows_then_the_rest():
    cu_q, cu_k = [0, 5, 5, 12, 20], [0, 7, 9, 9, 30]
    used_q, used_k = [3, 4, 7, 0], [7, 1, 5, 21]  # 4 > 0 rows and 5 > 0 rows: clipped
    oq, ok = seqused.split_offsets(cu_q, cu_k, used_q, used_k)
    assert oq.tolist() == [0, 3, 5, 5, 5, 5, 5, 12, 12, 12, 12, 20, 20]
    assert ok.tolist() == [0, 7, 7, 7, 8, 8, 9, 9, 9, 9, 30, 30, 30]
    assert (np.diff(oq) >= 0).all() and (np.diff(ok) >= 0).all()
    for b in range(4):  # split 3b + 1 has no key, 3b + 2 no query
        assert ok[3 * b + 2] == ok[3 * b + 1] and oq[3 * b + 3] == oq[3 * b + 2]
    # lengths not given: every row used (the unused parts empty)
    oq, ok = seqused.split_offsets(cu_q, cu_k, None, [7, 2, 0, 21])
    assert oq[1::3][:4].tolist() == cu_q[1:] and ok[1::3][:4].tolist() == [7, 9, 9, 30]


def _varlen_reference(q, k, v, cu_q, cu_k, **mask):
    """float64 attention of each packed sequence alone; rows of a sequence without keys 0."""
    out = np.zeros_like(q)
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] > cu_q[b] and cu_k[b + 1] > cu_k[b]:
            o, _ = reference.attention_naive(q[None, rq], k[None, rk], v[None, rk], **mask)
            out[rq] = np.nan_to_num(o[0])  # (rows a window leaves without a key: 0, as the kernels)
    return out


@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"window_size": (3, 1)},
                                  {"causal": True, "window_size": (2, 0)}])
def test_attention_over_the_split_is_attention_over_the_used_rows(mask):
    rng = np.random.default_rng(1)
    cu_q, cu_k = np.array([0, 6, 9, 9, 20]), np.array([0, 11, 13, 17, 25])
    used_q, used_k = np.array([4, 3, 0, 8]), np.array([9, 0, 2, 8])
    q, k, v = (rng.standard_normal((n, 2, 8)) for n in (20, 25, 25))
    q[[4, 5, 18, 19]] = k[[9, 10, 19, 24]] = v[[9, 10, 19, 24]] = np.nan  # unused rows hold anything
    oq, ok = seqused.split_offsets(cu_q, cu_k, used_q, used_k)
    got = _varlen_reference(q, k, v, oq, ok, **mask)
    for b in range(4):  # the used rows: attention to the used keys alone, aligned to the used lengths
        rq = slice(cu_q[b], cu_q[b] + used_q[b])
        want = _varlen_reference(q[rq], k[cu_k[b]:cu_k[b] + used_k[b]], v[cu_k[b]:cu_k[b] + used_k[b]],
                                 [0, used_q[b]], [0, used_k[b]], **mask)
        np.testing.assert_allclose(got[rq], want, rtol=1e-12, atol=1e-12)
        assert (got[cu_q[b] + used_q[b]:cu_q[b + 1]] == 0).all()  # unused rows: 0
    assert np.isfinite(got).all()


@pytest.mark.parametrize("lens,why", [([1, -2], r"seqused_k\[1\] = -2: lengths must be >= 0"),
                                      ([1], r"shape \(batch=2,\)"),
                                      ([1.0, 2.0], "integers"),
                                      ([[1, 2]], r"shape \(batch=2,\)")])
def test_host_lengths_are_checked(lens, why):
    with pytest.raises(ValueError, match=why):
        seqused.host_lengths(lens, "seqused_k", 2)
    assert seqused.host_lengths(np.array([0, 5], dtype=np.int64), "seqused_k", 2).dtype == np.int32


def test_seqused_with_a_score_mod_is_refused():
    with pytest.raises(NotImplementedError, match="seqused_q / seqused_k with a score_mod"):
        varlen._offsets(None, None, None, [1], None, None, score_mod=object())


class _CudaArray:
    """A stand-in for a CUDA array of another framework (DLPack device type 2)."""

    def __dlpack_device__(self):
        return (2, 0)


def test_optional_inputs_travel_with_the_arrays_when_on_a_device():
    cuda, host = _CudaArray(), np.array([3])
    names, arrays = ["q"], ["q array"]
    behind = _interop.optional_inputs(_interop.TORCH, names, arrays, a=host, b=cuda, c=None)
    assert names == ["q", "b"] and arrays == ["q array", cuda]
    assert set(behind) == {"a", "c"} and behind["a"] is host and behind["c"] is None
    assert _interop.rejoin(("b",), ("b's CuPy view",), behind) == {"a": host, "b": "b's CuPy view", "c": None}
    # in a CuPy call nothing travels: the body takes CuPy arrays as they are
    names, arrays = ["q"], ["q array"]
    assert _interop.optional_inputs(_interop.CUPY, names, arrays, b=cuda) == {"b": cuda} and names == ["q"]
