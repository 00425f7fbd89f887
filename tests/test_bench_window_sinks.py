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
