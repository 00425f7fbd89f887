"""scripts/bench_window_sinks.py on CPU: the window's visible (query, key) pairs, which its TFLOP/s
count (issue 13's window bar counts FLOPs over the visible entries only), against a brute-force mask."""
import importlib.util
import pathlib

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_window_sinks.py"


def _mod():
    spec = importlib.util.spec_from_file_location("bench_window_sinks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("nq,nk,left,right", [(7, 7, 2, 0), (5, 9, 1, 3), (9, 5, -1, 0), (6, 6, -1, -1),
                                               (6, 6, 0, -1), (8, 3, 2, 1), (40, 40, 0, 0), (3, 30, 4, 4)])
def test_visible_pairs_match_the_bottom_right_window_mask(nq, nk, left, right):
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    diag = i + nk - nq
    shown = ((left < 0) | (j >= diag - left)) & ((right < 0) | (j <= diag + right))
    assert _mod().visible_pairs(nq, nk, left, right) == int(shown.sum())


def test_a_window_of_4096_at_32k_shows_about_an_eighth():
    n = 32768
    assert _mod().visible_pairs(n, n, 4096, 0) == sum(min(i, 4096) + 1 for i in range(n))


@pytest.mark.parametrize("n,left,right,bq,bk", [(300, 40, 0, 64, 32), (300, 17, 23, 48, 80), (257, -1, 0, 64, 64),
                                                 (200, 0, -1, 32, 48), (129, -1, -1, 64, 128),
                                                 (512, 100, 100, 192, 128)])
def test_visited_pairs_count_every_block_pair_the_forward_visits(n, left, right, bq, bk):
    """Block pairs visited = those holding a visible (q, k), padding rows and keys included
    (kernels_cu/attn/block_range.cuh), brute force."""
    mq, mk = -(-n // bq), -(-n // bk)
    i, j = np.arange(mq * bq)[:, None], np.arange(mk * bk)[None, :]
    shown = ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right)) & (j < n)
    blocks = shown.reshape(mq, bq, mk, bk).any(axis=(1, 3))
    assert _mod().visited_pairs(n, left, right, bq, bk) == int(blocks.sum()) * bq * bk


def test_block_ceilings_of_a_4096_window_at_32k():
    m, n = _mod(), 32768
    vis = m.visible_pairs(n, n, 4096, 0)
    assert round(vis / m.visited_pairs(n, 4096, 0, 128, 128), 3) == 0.970
    assert round(vis / m.visited_pairs(n, 4096, 0, 128, 192), 3) == 0.941
