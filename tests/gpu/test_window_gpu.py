"""Sliding windows (window_size, with and without causal) on the GPU: forward on every forward
backend, backward on sm80 and the opt-in sm90 backward, against the float64 reference with the
2x rule (cuflash.testing's oracles take the mask record). Outputs poisoned before each launch."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule, fa_rule_grads, random_qkv
from tests.gpu.test_forward_gpu import backend  # noqa: F401  (the fixture: every forward backend of the GPU)

pytestmark = pytest.mark.gpu

# (seqlen_q, seqlen_k, causal, window_size): windows narrower and wider than a tile, one-sided,
# seqlen_q != seqlen_k both ways (bottom-right alignment), rows that see no key
CASES = [
    (256, 256, False, (32, 32)), (256, 256, True, (64, -1)), (256, 256, True, (64, 0)),
    (300, 517, False, (100, 7)), (517, 300, False, (0, 130)), (517, 300, True, (200, 0)),
    (1000, 1000, False, (-1, 50)), (1000, 1000, False, (300, -1)), (129, 1000, True, (1, 0)),
    (1000, 129, False, (5, 5)), (64, 64, False, (0, 0)),
    # PyTorch SDPA's is_causal alignment (top-left), alone and with a window
    (300, 517, True, (-1, -1), "top_left"), (517, 300, True, (-1, -1), "top_left"), (517, 300, True, (64, 0), "top_left"),
]
CASES = [c if len(c) == 5 else (*c, "bottom_right") for c in CASES]


def _poisoned(q, k, v, mask, backend):
    import cupy
    from cuflash import _forward

    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
    return _forward.forward(q, k, v, mask=mask, out=out, lse=lse, backend=backend)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk,causal,window,alignment", CASES)
def test_window_forward(nq, nk, causal, window, alignment, d, dtype, backend):  # noqa: F811
    import cupy
    import cuflash

    mask = MaskOptions.of(causal=causal, window_size=window, alignment=alignment)
    rng = np.random.default_rng(hash((nq, nk, causal, window, alignment, d, dtype)) % 2**32)
    q, k, v = random_qkv(rng, 2, nq, nk, 3, d, dtype_of(dtype))
    out, lse = _poisoned(q, k, v, mask, backend)
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any()) and not bool(cupy.isnan(lse).any())
    err, pt, allowed = fa_rule(out, q, k, v, mask, 1 / math.sqrt(d))
    assert err <= allowed, f"max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
    # the public entry point, same bits
    api = cuflash.attention(q, k, v, causal=causal, window_size=window, alignment=alignment, backend=backend)
    assert bool((api.view(cupy.uint16) == out.view(cupy.uint16)).all())


@pytest.mark.parametrize("bwd_backend", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk,causal,window,alignment", CASES[::2])
def test_window_backward(nq, nk, causal, window, alignment, d, dtype, bwd_backend):
    import cupy
    from cuflash import _backward, _forward, device

    if bwd_backend == "sm90" and tuple(device.query(0).cc) != (9, 0):
        pytest.skip("the sm90 backward needs cc 9.0")
    mask = MaskOptions.of(causal=causal, window_size=window, alignment=alignment)
    rng = np.random.default_rng(hash((nq, nk, causal, window, alignment, d, dtype, "bwd")) % 2**32)
    q, k, v = random_qkv(rng, 2, nq, nk, 3, d, dtype_of(dtype))
    dout, _, _ = random_qkv(rng, 2, nq, 1, 3, d, dtype_of(dtype))
    out, lse = _forward.forward(q, k, v, mask=mask)
    grads = _backward.backward(dout, q, k, v, out, lse, mask=mask, backend=bwd_backend)
    for g in grads:
        assert not bool(cupy.isnan(g.astype(cupy.float32)).any())
    for name, (err, pt, allowed) in fa_rule_grads(grads, q, k, v, dout, mask, 1 / math.sqrt(d)).items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"


def test_window_v1():
    """The v1 algorithm takes the window too (causal + left window, against the reference)."""
    import cupy
    from cuflash import _forward_v1

    mask = MaskOptions.of(causal=True, window_size=(50, 0))
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 1, 333, 333, 2, 64, dtype_of("bfloat16"))
    out, lse = _forward_v1.forward_v1(q, k, v, mask=mask)
    err, pt, allowed = fa_rule(out, q, k, v, mask, 1 / 8)
    assert err <= allowed and not bool(cupy.isnan(lse).any())
