"""v1 forward kernel (FlashAttention-1, Algorithm 1) on the GPU: the v2 forward's shape matrix against
the float64 reference by FlashAttention's 2x rule, and close agreement with v2 (out and lse)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash.testing import dtype_of, fa_rule, random_qkv
from tests.gpu.test_forward_gpu import SEQLEN_PAIRS, check_out_and_lse

pytestmark = pytest.mark.gpu


def _poisoned_v1(q, k, v, causal, config=None, softmax_scale=None):
    """Run v1 into output buffers pre-filled with NaN: an unwritten element stays NaN."""
    import cupy
    from cuflash._forward_v1 import forward_v1

    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
    return forward_v1(q, k, v, causal=causal, config=config, softmax_scale=softmax_scale, out=out, lse=lse)


def _v2_twin(v1_cfg):
    """The v2 config with v1's tiles: same S tiles and running maxima, so P is bit-identical."""
    from cuflash.tiles import FwdConfig

    cfg = FwdConfig(v1_cfg.head_dim, v1_cfg.block_q, v1_cfg.block_k, v1_cfg.warps, 2)
    assert cfg.structural_problem() is None
    return cfg


def _ulps_at_magnitude(x, n=2):
    """n ulps of x's dtype at the largest |x| (the atol floor of cuflash.testing.fa_rule)."""
    import cupy

    r = x.astype(cupy.float64)
    return n * float(cupy.abs((r + 0.3).astype(x.dtype).astype(cupy.float64) - 0.3 - r).max()) + 1e-6


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SEQLEN_PAIRS)
def test_v1_matches_reference(nq, nk, causal, d, dtype):
    import cupy

    rng = np.random.default_rng(hash(("v1", nq, nk, causal, d, dtype)) % 2**32)
    q, k, v = random_qkv(rng, 2, nq, nk, 3, d, dtype_of(dtype))
    out, lse = _poisoned_v1(q, k, v, causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == cupy.float32
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any()), "unwritten or NaN output"
    assert not bool(cupy.isnan(lse).any()), "unwritten lse"
    scale = 1 / math.sqrt(d)
    check_out_and_lse(out, lse, q, k, v, causal, scale)
    if causal and nq > nk:  # rows that see no key: exactly 0
        assert bool((out[:, : nq - nk].astype(cupy.float32) == 0).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(1000, 1000), (2048, 2048), (113, 203), (1024, 1023), (799, 3), (3000, 2500)])
def test_v1_agrees_with_v2(nq, nk, causal, d, dtype):
    """Same tiles: S and P are bit-identical, only the O accumulation differs (fp32 rounding)."""
    import cupy
    from cuflash import _forward, device, families
    from cuflash._forward_v1 import forward_v1

    rng = np.random.default_rng(hash(("v1v2", nq, nk, causal, d, dtype)) % 2**32)
    q, k, v = random_qkv(rng, 2, nq, nk, 3, d, dtype_of(dtype))
    cfg1 = families.FWD_V1.default(d, device.query(0).smem_optin)
    o1, l1 = forward_v1(q, k, v, causal=causal)
    o2, l2 = _forward.forward(q, k, v, causal=causal, config=_v2_twin(cfg1))
    diff = cupy.abs(o1.astype(cupy.float32) - o2.astype(cupy.float32))
    bound = _ulps_at_magnitude(o2)
    assert float(diff.max()) <= bound, f"max |v1 - v2| {float(diff.max()):.3e} > {bound:.3e}"
    same = float((o1.view(cupy.uint16) == o2.view(cupy.uint16)).mean())
    assert same >= 0.9, f"only {same:.1%} of outputs bit-identical"
    assert bool((cupy.isfinite(l1) == cupy.isfinite(l2)).all())
    fin = cupy.isfinite(l2)
    if bool(fin.any()):
        assert float(cupy.abs(l1 - l2)[fin].max()) < 1e-4


@pytest.mark.parametrize("d", [64, 128])
def test_every_v1_config_in_space(d):
    """Every v1 config, not only the default (ragged and causal shapes, several K/V tiles)."""
    from cuflash import device, families

    rng = np.random.default_rng(d)
    for cfg in families.FWD_V1.space(d, device.query(0).smem_optin):
        for nq, nk, causal in ((200, 333, True), (129, 70, True), (257, 257, False), (70, 129, False)):
            q, k, v = random_qkv(rng, 1, nq, nk, 2, d, dtype_of("bfloat16"))
            out, _ = _poisoned_v1(q, k, v, causal, config=cfg)
            err, pt_err, allowed = fa_rule(out, q, k, v, causal, 1 / math.sqrt(d))
            assert err <= allowed, f"{cfg} nq={nq} nk={nk} causal={causal}: err {err:.3e} > {allowed:.3e}"


def test_v1_strided_inputs_and_nan_padding():
    """Slices of a packed qkv array and views into NaN-padded buffers: same bits as contiguous inputs."""
    import cupy
    from cuflash._forward_v1 import forward_v1

    rng = np.random.default_rng(7)
    bf = dtype_of("bfloat16")
    qkv = cupy.asarray(rng.standard_normal((2, 300, 3, 4, 128)).astype(np.float32)).astype(bf)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    out, lse = forward_v1(q, k, v, causal=True)
    ref, lse_ref = forward_v1(*(cupy.ascontiguousarray(x) for x in (q, k, v)), causal=True)
    assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all()) and bool((lse == lse_ref).all())
    for nq, nk in ((17, 113), (130, 65), (1, 1), (200, 256)):
        bufs = [cupy.full((2, 256, 3, 64), cupy.nan, dtype=cupy.float32).astype(bf) for _ in range(3)]
        q, k, v = random_qkv(rng, 2, nq, nk, 3, 64, bf)
        views = []
        for buf, x in zip(bufs, (q, k, v)):
            buf[:, : x.shape[1]] = x
            views.append(buf[:, : x.shape[1]])
        for causal in (False, True):
            out, _ = forward_v1(*views, causal=causal)
            ref, _ = forward_v1(q, k, v, causal=causal)
            assert not bool(cupy.isnan(out.astype(cupy.float32)).any())
            assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all())


def test_v1_large_logits_constant_inputs_and_custom_scale():
    import cupy
    from cuflash._forward_v1 import forward_v1

    rng = np.random.default_rng(3)
    for scale in (8.0, 30.0):
        q, k, v = random_qkv(rng, 1, 333, 333, 2, 128, dtype_of("bfloat16"), scale=scale)
        for causal in (False, True):
            out, _ = forward_v1(q, k, v, causal=causal)
            assert bool(cupy.isfinite(out.astype(cupy.float32)).all())
            err, pt_err, allowed = fa_rule(out, q, k, v, causal, 1 / math.sqrt(128))
            assert err <= allowed, f"scale {scale}: {err:.3e} > {allowed:.3e}"
    c = cupy.full((1, 300, 2, 64), 1000.0, dtype=cupy.float32).astype(dtype_of("float16"))
    out, _ = forward_v1(c, c, c)
    assert float(cupy.abs(out.astype(cupy.float32) - 1000.0).max()) <= 0.5
    q, k, v = random_qkv(rng, 2, 177, 300, 2, 64, dtype_of("bfloat16"))
    s = cupy.cuda.Stream(non_blocking=True)
    # the inputs were made on the legacy default stream, which a non-blocking stream does not wait for
    s.wait_event(cupy.cuda.get_current_stream().record())
    with s:
        out, _ = forward_v1(q, k, v, softmax_scale=0.3)
    s.synchronize()
    err, pt_err, allowed = fa_rule(out, q, k, v, False, 0.3)
    assert err <= allowed


def test_v1_deterministic():
    import cupy
    from cuflash._forward_v1 import forward_v1

    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 2, 1000, 1000, 4, 128, dtype_of("bfloat16"))
    o0, l0 = forward_v1(q, k, v, causal=True)
    for _ in range(10):
        o1, l1 = forward_v1(q, k, v, causal=True)
        assert bool((o0.view(cupy.uint16) == o1.view(cupy.uint16)).all())
        assert bool((l0 == l1).all())


def test_v1_refuses_a_v2_config():
    from cuflash import families
    from cuflash._forward_v1 import forward_v1

    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 64, 64, 1, 64, dtype_of("bfloat16"))
    with pytest.raises(TypeError, match="V1Config"):
        forward_v1(q, k, v, config=families.FWD.default(64))
    with pytest.raises(ValueError, match="head_dim"):
        forward_v1(q, k, v, config=families.FWD_V1.default(128))
