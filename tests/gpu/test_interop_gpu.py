"""DLPack interop on the GPU: other producers and JAX (eager) give the CuPy path's bits, zero-copy."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from cuflash.testing import dtype_of, fa_rule_grads, random_qkv

pytestmark = pytest.mark.gpu


class Wrapped:
    """A DLPack producer cuflash has never heard of (here: backed by a CuPy array)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def _same_bits(a, b) -> bool:
    import cupy

    return a.shape == b.shape and a.dtype == b.dtype and bool((a.view(cupy.uint8) == b.view(cupy.uint8)).all())


def test_generic_dlpack_producer_zero_copy_and_same_bits():
    import cupy
    import cuflash
    from cuflash import _interop

    rng = np.random.default_rng(0)
    bf = dtype_of("bfloat16")
    qkv = cupy.asarray(rng.standard_normal((2, 96, 3, 2, 64)).astype(np.float32)).astype(bf)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # strided views
    ref_out, ref_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    wq, wk, wv = Wrapped(q), Wrapped(k), Wrapped(v)
    for w, a in ((wq, q), (wk, k), (wv, v)):
        view = _interop.to_cupy(w, _interop.DLPACK)
        assert view.data.ptr == a.data.ptr and view.strides == a.strides and view.dtype == a.dtype
    out, lse = cuflash.attention(wq, wk, wv, causal=True, return_lse=True)
    assert type(out) is cupy.ndarray and type(lse) is cupy.ndarray  # unknown producers get CuPy arrays
    assert _same_bits(out, ref_out) and _same_bits(lse, ref_lse)


def test_attention_backward_cupy_path():
    """The public backward on CuPy arrays: the FlashAttention 2x rule against float64, deterministic bits."""
    import cupy
    import cuflash

    rng = np.random.default_rng(1)
    bf = dtype_of("bfloat16")
    q, k, v = random_qkv(rng, 2, 200, 256, 2, 64, bf)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(bf)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    g1 = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    g2 = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for a, b, x in zip(g1, g2, (q, k, v)):
        assert type(a) is cupy.ndarray and a.shape == x.shape and a.dtype == x.dtype
        assert _same_bits(a, b), "deterministic backward differs between two runs"
    for name, (err, pt_err, allowed) in fa_rule_grads(g1, q, k, v, dout, True, 1 / math.sqrt(64)).items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype err {pt_err:.3e})"


def test_backward_bad_arguments_before_launch():
    import cupy
    import cuflash

    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 64, 64, 2, 64, dtype_of("bfloat16"))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    bad = [  # the message names the argument (exact wording: cuflash.problem.resolve_backward)
        ((out.astype(cupy.float16), q, k, v, out, lse), "dout must"),
        ((out[:, :32], q, k, v, out, lse), "dout must"),
        ((out, q, k, v, out[:, :, :1], lse), "out must"),
        ((out, q, k, v, out, lse.astype(cupy.float16)), "lse must"),
        ((out, q, k, v, out, lse[:, :1]), "lse must"),
        ((out, q, k, v, out, lse.get()), "lse must be on a CUDA device"),
    ]
    for args, words in bad:
        with pytest.raises((TypeError, ValueError), match=words):
            cuflash.attention_backward(*args)
    dq, dk, dv = cuflash.attention_backward(out, q, k, v, out, lse)  # still healthy
    assert bool(cupy.isfinite(dq.astype(cupy.float32)).all())


@pytest.fixture(scope="module")
def jax_gpu():
    # JAX grabs 75% of GPU memory at start-up by default; CuPy (and torch) share this GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax", reason="jax not installed: JAX interop not tested")
    try:
        devs = jax.devices("cuda")
    except RuntimeError as e:
        pytest.skip(f"jax has no CUDA backend here ({e})")
    return jax, devs[0]


def test_jax_eager_matches_cupy(jax_gpu, monkeypatch):
    import cupy
    import cuflash
    from cuflash import _interop

    jax, dev = jax_gpu
    rng = np.random.default_rng(3)
    bf = dtype_of("bfloat16")
    q, k, v = random_qkv(rng, 2, 130, 190, 2, 128, bf)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(bf)
    ref_out, ref_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    ref_grads = cuflash.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=True, deterministic=True)

    jq, jk, jv, jdo = (jax.device_put(x.get(), dev) for x in (q, k, v, dout))
    for jx in (jq, jk, jv):  # zero-copy in
        assert _interop.to_cupy(jx, _interop.JAX).data.ptr == jx.unsafe_buffer_pointer()
    seen = {}
    from cuflash import _forward

    real = _forward.forward

    def spy(*a, **kw):
        o, l = real(*a, **kw)
        seen["out"] = o.data.ptr
        return o, l

    monkeypatch.setattr(_forward, "forward", spy)  # the DLPack path looks it up per call (api.forward_fn)
    out, lse = cuflash.attention(jq, jk, jv, causal=True, return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert out.dtype == jq.dtype and out.shape == jq.shape and str(lse.dtype) == "float32"
    assert out.unsafe_buffer_pointer() == seen["out"]  # zero-copy out
    assert np.array_equal(np.asarray(out).view(np.uint16), ref_out.get().view(np.uint16))
    assert np.array_equal(np.asarray(lse), ref_lse.get())

    grads = cuflash.attention_backward(jdo, jq, jk, jv, out, lse, causal=True, deterministic=True)
    for g, r in zip(grads, ref_grads):
        assert isinstance(g, jax.Array)
        assert np.array_equal(np.asarray(g).view(np.uint16), r.get().view(np.uint16))


def test_jax_jit_explains(jax_gpu):
    import cuflash

    jax, dev = jax_gpu
    x = jax.device_put(np.zeros((1, 16, 1, 64), dtype=dtype_of("bfloat16")), dev)
    with pytest.raises(TypeError, match="JAX tracer"):
        jax.jit(lambda a: cuflash.attention(a, a, a))(x)
