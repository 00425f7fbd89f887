"""Forward kernels on the GPU against the float64 reference, by FlashAttention's 2x rule (R2, R5, R6, R10).

The matrix runs on every forward backend the device has (`backend`: sm80 everywhere, sm90 on
compute capability 9.0 with cuda-bindings installed), each forced by cuflash.attention(backend=...)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash.testing import backend_unavailable, dtype_of, fa_rule, naive, random_qkv

pytestmark = pytest.mark.gpu



def check_out_and_lse(out, lse, q, k, v, causal, scale):
    """out by FlashAttention's 2x rule against the float64 reference; lse -inf exactly where the
    reference's is, and within 1e-3 elsewhere (shared by the forward, v1 and GQA tests)."""
    import cupy

    err, pt_err, allowed = fa_rule(out, q, k, v, causal, scale)
    assert err <= allowed, f"max err {err:.3e} > allowed {allowed:.3e} (same-dtype err {pt_err:.3e})"
    _, lse_ref = naive(q, k, v, causal, scale, cupy.float64)
    finite = cupy.isfinite(lse_ref)
    assert bool((cupy.isfinite(lse) == finite).all()), "lse -inf pattern differs from reference"
    if bool(finite.any()):
        assert float(cupy.abs(lse.astype(cupy.float64) - lse_ref)[finite].max()) < 1e-3

@pytest.fixture(params=["sm80", "sm90"])
def backend(request):
    why = backend_unavailable(request.param)
    if why:
        pytest.skip(f"{request.param} forward not on this GPU: {why}")
    return request.param

SEQLEN_PAIRS = [(1, 1), (17, 17), (113, 113), (128, 128), (255, 255), (1000, 1000), (2048, 2048),
                (1, 239), (239, 1), (3, 799), (799, 3), (113, 203), (128, 217), (1023, 1024), (1024, 1023)]


def _poisoned_call(q, k, v, causal, backend=None):
    """Run the forward into output buffers pre-filled with NaN: an unwritten element stays NaN."""
    import cupy
    from cuflash import _forward

    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
    return _forward.forward(q, k, v, causal=causal, out=out, lse=lse, backend=backend)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SEQLEN_PAIRS)
def test_forward_matches_reference(nq, nk, causal, d, dtype, backend):
    import cupy
    import cuflash

    rng = np.random.default_rng(hash((nq, nk, causal, d, dtype)) % 2**32)
    b, h = 2, 3
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of(dtype))
    out, lse = _poisoned_call(q, k, v, causal, backend)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == cupy.float32
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any()), "unwritten or NaN output"
    assert not bool(cupy.isnan(lse).any()), "unwritten lse"
    api_out = cuflash.attention(q, k, v, causal=causal, backend=backend)  # the public entry point: same bits
    assert bool((api_out.view(cupy.uint16) == out.view(cupy.uint16)).all())
    scale = 1 / math.sqrt(d)
    check_out_and_lse(out, lse, q, k, v, causal, scale)
    if causal and nq > nk:  # rows that see no key: exactly 0
        dead = nq - nk
        assert bool((out[:, :dead].astype(cupy.float32) == 0).all())


def test_reference_on_gpu_matches_numpy_oracle():
    """The CuPy float64 naive used by these tests equals cuflash.reference (small case)."""
    import cupy
    from cuflash import reference

    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, 37, 53, 3, 64, cupy.float16)
    for causal in (False, True):
        o_gpu, lse_gpu = naive(q, k, v, causal, 0.125, cupy.float64)
        o_np, lse_np = reference.attention_naive(q.get(), k.get(), v.get(), causal=causal, softmax_scale=0.125)
        np.testing.assert_allclose(o_gpu.get(), o_np, atol=1e-12)
        np.testing.assert_allclose(lse_gpu.get(), lse_np, atol=1e-12)


@pytest.mark.parametrize("d", [64, 128])
def test_every_config_in_space(d, backend):
    """Every config the tuner may pick is correct, not only the default (ragged and causal shapes)."""
    from cuflash import _forward, device, families

    rng = np.random.default_rng(d)
    family = next(f for f in families.FORWARDS if f.backend == backend)
    for cfg in family.space(d, device.query(0).smem_optin):
        for nq, nk, causal in ((200, 333, True), (129, 70, True), (257, 257, False)):
            q, k, v = random_qkv(rng, 1, nq, nk, 2, d, dtype_of("bfloat16"))
            out, _ = _forward.forward(q, k, v, causal=causal, config=cfg)
            err, pt_err, allowed = fa_rule(out, q, k, v, causal, 1 / math.sqrt(d))
            assert err <= allowed, f"{cfg} nq={nq} nk={nk} causal={causal}: err {err:.3e} > {allowed:.3e}"


def test_strided_inputs_used_without_copy(backend):
    """Slices of a packed (b, n, 3, h, d) qkv array, and (b, h, n, d) memory seen as (b, n, h, d):
    same bits as contiguous copies (R10)."""
    import cupy
    import cuflash

    rng = np.random.default_rng(7)
    qkv = cupy.asarray(rng.standard_normal((2, 300, 3, 4, 128)).astype(np.float32)).astype(dtype_of("bfloat16"))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    out = cuflash.attention(q, k, v, causal=True, backend=backend)
    ref = cuflash.attention(cupy.ascontiguousarray(q), cupy.ascontiguousarray(k), cupy.ascontiguousarray(v), causal=True,
                            backend=backend)
    assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all())
    bhsd = [cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)]
    views = [x.transpose(0, 2, 1, 3) for x in bhsd]
    out = cuflash.attention(*views, causal=True, backend=backend)
    assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all())


def test_nan_padding_never_read(backend):
    """Inputs are views into NaN-padded buffers: any out-of-bounds read would leak NaN (R6)."""
    import cupy
    import cuflash

    rng = np.random.default_rng(11)
    bf = dtype_of("bfloat16")
    for nq, nk in ((17, 113), (130, 65), (1, 1)):
        bufs = [cupy.full((2, 256, 3, 64), cupy.nan, dtype=cupy.float32).astype(bf) for _ in range(3)]
        q, k, v = random_qkv(rng, 2, nq, nk, 3, 64, bf)
        views = []
        for buf, x in zip(bufs, (q, k, v)):
            buf[:, : x.shape[1]] = x
            views.append(buf[:, : x.shape[1]])
        for causal in (False, True):
            out = cuflash.attention(*views, causal=causal, backend=backend)
            ref = cuflash.attention(q, k, v, causal=causal, backend=backend)
            assert not bool(cupy.isnan(out.astype(cupy.float32)).any())
            assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all())


def test_large_logits_and_constant_inputs_stay_finite(backend):
    """Large-magnitude, very small and constant inputs (R4): finite and within the rule."""
    import cupy
    import cuflash

    rng = np.random.default_rng(3)
    for scale in (8.0, 30.0):
        q, k, v = random_qkv(rng, 1, 333, 333, 2, 128, dtype_of("bfloat16"), scale=scale)
        for causal in (False, True):
            out = cuflash.attention(q, k, v, causal=causal, backend=backend)
            assert bool(cupy.isfinite(out.astype(cupy.float32)).all())
            err, pt_err, allowed = fa_rule(out, q, k, v, causal, 1 / math.sqrt(128))
            assert err <= allowed, f"scale {scale}: {err:.3e} > {allowed:.3e}"
    # very small logits (tiny inputs, a tiny softmax_scale, and subnormal-range scores): a near-uniform
    # softmax, no underflow to 0 / 0
    for scale, sm_scale in ((1e-3, 1 / math.sqrt(128)), (1.0, 1e-6), (1e-2, 1e-4)):
        q, k, v = random_qkv(rng, 1, 333, 333, 2, 128, dtype_of("bfloat16"), scale=scale)
        for causal in (False, True):
            out = cuflash.attention(q, k, v, causal=causal, softmax_scale=sm_scale, backend=backend)
            assert bool(cupy.isfinite(out.astype(cupy.float32)).all())
            err, pt_err, allowed = fa_rule(out, q, k, v, causal, sm_scale)
            assert err <= allowed, f"small logits {scale}, {sm_scale}: {err:.3e} > {allowed:.3e}"
    c = cupy.full((1, 100, 2, 64), 1000.0, dtype=cupy.float32).astype(dtype_of("float16"))
    out = cuflash.attention(c, c, c, backend=backend)
    # P is rounded to fp16 before P V while l sums unrounded P (as in FlashAttention): 1 ulp at 1000
    assert float(cupy.abs(out.astype(cupy.float32) - 1000.0).max()) <= 0.5


def test_deterministic_forward(backend):
    import cupy
    import cuflash

    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 4, 1000, 1000, 4, 128, dtype_of("bfloat16"))
    o0, l0 = cuflash.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    for _ in range(20):
        o1, l1 = cuflash.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        assert bool((o0.view(cupy.uint16) == o1.view(cupy.uint16)).all())
        assert bool((l0 == l1).all())


def test_custom_scale_and_nondefault_stream(backend):
    import cupy
    import cuflash

    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, 2, 177, 300, 2, 64, dtype_of("bfloat16"))
    s = cupy.cuda.Stream(non_blocking=True)
    # the inputs were made on the legacy default stream, which a non-blocking stream does not wait for
    s.wait_event(cupy.cuda.get_current_stream().record())
    with s:
        out = cuflash.attention(q, k, v, softmax_scale=0.3, backend=backend)
    s.synchronize()
    err, pt_err, allowed = fa_rule(out, q, k, v, False, 0.3)
    assert err <= allowed


def test_more_than_2_31_elements_uses_64_bit_offsets(backend):
    """q has > 2^31 elements (4.3 GB in bf16): offsets must be 64-bit (R8). Last batch checked."""
    import cupy
    import cuflash

    free, _ = cupy.cuda.runtime.memGetInfo()
    b, n, h, d = 16400, 128, 8, 128  # 2.15e9 elements per tensor
    if free < 5 * b * n * h * d * 2:
        pytest.skip(f"needs ~{5 * b * n * h * d * 2 / 2**30:.0f} GiB of free GPU memory")
    assert b * n * h * d > 2**31
    bf = dtype_of("bfloat16")
    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf) for _ in range(3))
    out = cuflash.attention(q, k, v, causal=True, backend=backend)
    tail = slice(b - 2, b)
    err, pt_err, allowed = fa_rule(out[tail], q[tail], k[tail], v[tail], True, 1 / math.sqrt(d))
    assert err <= allowed, f"last batches: {err:.3e} > {allowed:.3e}"
    del q, k, v, out
    cupy.get_default_memory_pool().free_all_blocks()


# ------------------------------------------------------------------------------ backend dispatch

def test_given_configs_plans_are_built_once():
    """A call with an explicit config (the tuner's trials, tests) takes a cached plan the second time
    (keyed by the config as well): a trial times the launch, not a plan build (~0.1 ms of host time,
    which bounded the tuner's timings of short kernels); another config gets a plan of its own."""
    import dataclasses

    from cuflash import _backward, _forward, families

    rng = np.random.default_rng(17)
    q, k, v = random_qkv(rng, 2, 300, 300, 2, 64, dtype_of("bfloat16"))
    dout = random_qkv(rng, 2, 300, 300, 2, 64, dtype_of("bfloat16"))[0]
    fam = families.FWD_SM90 if backend_unavailable("sm90") is None else families.FWD
    tile = fam.defaults[64][0]
    other = dataclasses.replace(tile, persistent=0) if fam is families.FWD_SM90 else dataclasses.replace(tile, stages=3)
    _forward._plans.clear()
    _backward._plans.clear()
    first, lse = _forward.forward(q, k, v, causal=True, config=tile)
    again, _ = _forward.forward(q, k, v, causal=True, config=tile)
    assert len(_forward._plans) == 1
    third, _ = _forward.forward(q, k, v, causal=True, config=other)
    assert len(_forward._plans) == 2
    for x in (again, third):
        assert bool((x.view(np.uint16) == first.view(np.uint16)).all())
    btile = families.BWD.defaults[64][0]
    grads = [_backward.backward(dout, q, k, v, first, lse, causal=True, config=btile, backend="sm80") for _ in range(2)]
    assert len(_backward._plans) == 1
    assert all(bool((a.view(np.uint16) == b.view(np.uint16)).all()) for a, b in zip(grads[0][1:], grads[1][1:]))
    _forward._plans.clear()
    _backward._plans.clear()


def test_auto_backend_is_sm90_where_it_runs(monkeypatch):
    """backend=None runs the Hopper kernel on a cc 9.0 GPU (and the sm80 one elsewhere): same bits as forced."""
    import cupy
    import cuflash
    from cuflash import _forward, _forward_sm90

    monkeypatch.delenv("CUFLASH_BACKEND", raising=False)
    want = "sm90" if backend_unavailable("sm90") is None else "sm80"
    built = []
    real = _forward_sm90.plan
    monkeypatch.setattr(_forward_sm90, "plan", lambda *a, **kw: built.append(a[1]) or real(*a, **kw))
    _forward._plans.clear()
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, 2, 200, 300, 3, 128, dtype_of("bfloat16"))
    out = cuflash.attention(q, k, v, causal=True)
    assert bool(built) == (want == "sm90")
    forced = cuflash.attention(q, k, v, causal=True, backend=want)
    assert bool((out.view(cupy.uint16) == forced.view(cupy.uint16)).all())
    monkeypatch.setenv("CUFLASH_BACKEND", "sm80")  # read when a plan is built: a new shape
    built.clear()
    q2 = q[:, :199]
    sm80 = cuflash.attention(q2, k, v, causal=True)
    assert not built
    assert bool((sm80.view(cupy.uint16) == cuflash.attention(q2, k, v, causal=True, backend="sm80").view(cupy.uint16)).all())


def test_broadcast_k_falls_back_to_sm80_and_forcing_sm90_says_why(monkeypatch):
    """A k, v shared by all heads (stride 0, expand): sm80 takes it, TMA cannot describe it."""
    import cupy
    import cuflash

    monkeypatch.delenv("CUFLASH_BACKEND", raising=False)
    rng = np.random.default_rng(17)
    q, k, v = random_qkv(rng, 2, 100, 150, 4, 64, dtype_of("float16"))
    k1, v1 = (cupy.broadcast_to(x[:, :, :1], x.shape) for x in (k, v))
    assert k1.strides[2] == 0
    out = cuflash.attention(q, k1, v1)
    ref = cuflash.attention(q, k1, v1, backend="sm80")
    assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all())
    err, _, allowed = fa_rule(out, q, cupy.ascontiguousarray(k1), cupy.ascontiguousarray(v1), False, 1 / math.sqrt(64))
    assert err <= allowed
    with pytest.raises(ValueError, match="backend='sm90' cannot run this call"):
        cuflash.attention(q, k1, v1, backend="sm90")


def test_forcing_sm90_off_hopper_raises_before_any_launch():
    import cuflash
    from cuflash import device

    if device.query(0).cc == (9, 0):
        pytest.skip("a compute capability 9.0 GPU runs the sm90 forward")
    rng = np.random.default_rng(19)
    q, k, v = random_qkv(rng, 1, 64, 64, 2, 64, dtype_of("bfloat16"))
    with pytest.raises(ValueError, match="backend='sm90' cannot run this call.*compute capability"):
        cuflash.attention(q, k, v, backend="sm90")
