"""merge_attention on the GPU (passes on the H200): the CuPy and torch paths agree with the NumPy one, and
merging cuflash's own partial results over key splits meets the 2x rule against the float64
reference of attention over all keys."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash.merge import merge_attention
from cuflash.testing import dtype_of, fa_rule, random_qkv

pytestmark = pytest.mark.gpu


def _parts(rng, n_parts=3):
    outs = [rng.standard_normal((2, 50, 3, 64)).astype(np.float32) for _ in range(n_parts)]
    lses = [rng.standard_normal((2, 3, 50)).astype(np.float32) * 4 for _ in range(n_parts)]
    lses[1][0, 1, :7] = -np.inf
    return outs, lses


def test_cupy_path_matches_numpy():
    import cupy

    outs, lses = _parts(np.random.default_rng(0))
    want = merge_attention(outs, lses)
    got = merge_attention([cupy.asarray(o) for o in outs], [cupy.asarray(x) for x in lses])
    for g, w in zip(got, want):
        np.testing.assert_allclose(cupy.asnumpy(g), w, rtol=1e-5, atol=1e-6)


def test_torch_path_matches_numpy_and_is_differentiable():
    torch = pytest.importorskip("torch")
    outs, lses = _parts(np.random.default_rng(1))
    want = merge_attention(outs, lses)
    to = [torch.tensor(o, device="cuda", requires_grad=True) for o in outs]
    tl = [torch.tensor(x, device="cuda") for x in lses]
    out, lse = merge_attention(to, tl)
    for g, w in zip((out, lse), want):
        np.testing.assert_allclose(g.detach().cpu().numpy(), w, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in to)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_merged_cuflash_parts_meet_the_2x_rule(dtype):
    import cuflash

    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 2, 300, 1000, 4, 128, dtype_of(dtype))
    edges = [0, 128, 129, 640, 1000]
    parts = [cuflash.attention(q, k[:, a:e], v[:, a:e], return_lse=True) for a, e in zip(edges, edges[1:])]
    out, lse = merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == q.dtype
    err, pt, allowed = fa_rule(out, q, k, v, False, 1 / math.sqrt(128))
    assert err <= allowed, f"merged: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
    _, full_lse = cuflash.attention(q, k, v, return_lse=True)
    assert float(abs(lse - full_lse).max()) < 1e-3
