"""Empty calls on the GPU: a batch, heads or seqlen of 0 give outputs of the right shapes without a
launch; seqlen_k 0 gives out 0 and lse -inf (every row sees no key), the backward zero gradients.
CuPy arrays (zero strides), torch tensors (autograd), forward v1 and v2."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash.testing import dtype_of

pytestmark = pytest.mark.gpu

CASES = [  # (b, nq, nk, h, d)
    (0, 16, 16, 2, 64),
    (2, 0, 16, 2, 64),
    (2, 16, 0, 2, 128),
    (2, 0, 0, 2, 64),
    (2, 16, 16, 0, 64),
]


def _no_launch(monkeypatch):
    from cuflash import _compile

    def fail(*a, **k):
        raise AssertionError("an empty call compiled or launched a kernel")

    monkeypatch.setattr(_compile, "get_kernel", fail)
    monkeypatch.setattr(_compile, "get_aux_kernel", fail)


def _arrays(b, nq, nk, h, d, dtype):
    import cupy

    rng = np.random.default_rng(0)
    mk = lambda n: cupy.asarray(rng.standard_normal((b, n, h, d)).astype(np.float32)).astype(dtype)
    return mk(nq), mk(nk), mk(nk)


@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("algorithm", ["v2", "v1"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_empty_forward_and_backward_cupy(monkeypatch, shape, algorithm, causal, dtype):
    import cupy

    import cuflash

    _no_launch(monkeypatch)
    b, nq, nk, h, d = shape
    q, k, v = _arrays(b, nq, nk, h, d, dtype_of(dtype))
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, algorithm=algorithm)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, h, nq) and lse.dtype == cupy.float32
    assert not bool(cupy.any(out.astype(cupy.float32)))
    assert bool(cupy.all(cupy.isneginf(lse)))  # vacuous where lse is empty
    dq, dk, dv = cuflash.attention_backward(out, q, k, v, out, lse, causal=causal)
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and not bool(cupy.any(g.astype(cupy.float32)))
    # with dropout, deterministically, and into caller-given (poisoned) outputs
    out2, lse2 = cuflash.attention(q, k, v, causal=causal, return_lse=True, dropout_p=0.1, seed=1)
    assert not bool(cupy.any(out2.astype(cupy.float32))) and bool(cupy.all(cupy.isneginf(lse2)))
    dq, dk, dv = cuflash.attention_backward(out, q, k, v, out, lse, causal=causal, deterministic=True,
                                            dropout_p=0.1, seed=1)
    assert not any(bool(cupy.any(g.astype(cupy.float32))) for g in (dq, dk, dv))
    from cuflash import _forward

    o3, l3 = cupy.full(q.shape, 7, dtype=q.dtype), cupy.full((b, h, nq), 7, dtype=cupy.float32)
    o3, l3 = _forward.forward(q, k, v, out=o3, lse=l3)
    assert not bool(cupy.any(o3.astype(cupy.float32))) and bool(cupy.all(cupy.isneginf(l3)))


@pytest.mark.parametrize("shape", CASES)
def test_empty_torch_autograd(monkeypatch, shape):
    torch = pytest.importorskip("torch")
    import cuflash

    b, nq, nk, h, d = shape
    mk = lambda n: torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = mk(nq), mk(nk), mk(nk)
    _no_launch(monkeypatch)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (b, h, nq)
    assert not out.any() and bool(torch.isneginf(lse).all())
    out.float().sum().backward()
    for x in (q, k, v):
        assert x.grad.shape == x.shape and not x.grad.any()
    if nk == 0 and nq > 0 and b * h > 0:  # PyTorch's math SDPA: an empty sum, 0 as well
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(x.detach().float().transpose(1, 2) for x in (q, k, v)))
        torch.testing.assert_close(out.float(), ref.transpose(1, 2))
