"""cache_batch_idx without a GPU (cuflash/cache_batch.py): a contiguous cache's sequences as the
pages of a paged cache, the cut of sequences the decode kernel cannot address as one page, the
host table and its checks, and the argument checks made before anything runs."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import cache_batch, kvcache
from cuflash.problem import ArrayInfo


def _info(shape, strides=None, itemsize=2):
    if strides is None:  # C order
        strides, acc = [], itemsize
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return ArrayInfo(tuple(shape), "bfloat16", itemsize, tuple(strides), 0, 0)


def test_a_sequence_is_one_page_where_the_kernel_addresses_it():
    assert cache_batch.pages_per_sequence([_info((7, 600, 8, 128))] * 2) == 1
    # rows padded apart (a cache sliced from a wider one): still one page per sequence
    assert cache_batch.pages_per_sequence([_info((7, 600, 8, 128), (2 * 600 * 4096, 2 * 4096, 256, 2))]) == 1


def test_long_sequences_are_cut_into_the_fewest_equal_pages():
    # 2^21 + 2^20 rows of 1024 elements: one page would span 3 x 2^30 elements; two pages of 3 x 2^19 rows fit
    cap = 3 * 2**20
    info = _info((2, cap, 8, 128))
    assert kvcache.page_layout_problem(info.shape, info.strides, 2) is not None
    assert cache_batch.pages_per_sequence([info, info]) == 2
    # 2^22 rows: two pages of 2^21 rows end just below 2^31 elements
    assert cache_batch.pages_per_sequence([_info((1, 2**22, 8, 128))]) == 2
    # 5 x 2^20 rows: 2 does not divide into pages that fit (2.5 x 2^20 rows), 3 does not divide 5 x 2^20; 4 does
    assert cache_batch.pages_per_sequence([_info((1, 5 * 2**20, 8, 128))]) == 4


def test_no_cut_without_sequences_laid_end_to_end():
    cap = 3 * 2**20
    gap = _info((2, cap, 8, 128), ((cap + 16) * 2048, 2048, 256, 2))  # sequences apart: pages could not follow
    assert cache_batch.pages_per_sequence([gap]) is None
    both = [_info((2, cap, 8, 128)), gap]  # one cache cuttable, the other not: no common cut
    assert cache_batch.pages_per_sequence(both) is None


def test_host_table():
    np.testing.assert_array_equal(cache_batch.host_table([4, 0, 4], 3, 5, 1), [[4], [0], [4]])
    np.testing.assert_array_equal(cache_batch.host_table(np.array([2, 0]), 2, 3, 3), [[6, 7, 8], [0, 1, 2]])
    assert cache_batch.host_table((1,), 1, 2, 1).dtype == np.int32


@pytest.mark.parametrize("idx,why", [([0, 5], r"cache_batch_idx\[1\] = 5 is not a sequence of the cache \(k_cache has 5\)"),
                                     ([-1, 0], r"cache_batch_idx\[0\] = -1"),
                                     ([0], r"shape \(batch=2,\)"),
                                     ([[0, 1]], r"shape \(batch=2,\)"),
                                     ([0.0, 1.0], "integers")])
def test_host_indices_are_checked(idx, why):
    with pytest.raises(ValueError, match=why):
        cache_batch.host_table(idx, 2, 5, 1)


def test_cache_batch_idx_does_not_combine_with_a_block_table():
    with pytest.raises(ValueError, match="cache_batch_idx and block_table cannot be combined"):
        kvcache.attention_with_kvcache(None, None, None, cache_seqlens=1, cache_batch_idx=[0], block_table=[[0]])
