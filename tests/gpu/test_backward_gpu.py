"""Backward kernels on the GPU against float64 gradients, by FlashAttention's 2x rule (issue 3)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash.testing import dtype_of, fa_rule_grads, random_qkv
from tests.gpu.test_forward_gpu import SEQLEN_PAIRS

pytestmark = pytest.mark.gpu


def _fwd_bwd(q, k, v, dout, causal, deterministic=False, config=None, dq_config=None):
    from cuflash import _backward, _forward

    out, lse = _forward.forward(q, k, v, causal=causal)
    grads = _backward.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                               config=config, dq_config=dq_config)
    return out, lse, grads


def _check(grads, q, k, v, dout, causal, what=""):
    import cupy

    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert not bool(cupy.isnan(g.astype(cupy.float32)).any()), f"NaN in gradient {what}"
    res = fa_rule_grads(grads, q, k, v, dout, causal, 1 / math.sqrt(q.shape[-1]))
    for name, (err, pt_err, allowed) in res.items():
        assert err <= allowed, f"{name}{what}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt_err:.3e})"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SEQLEN_PAIRS)
def test_backward_matches_reference(nq, nk, causal, d, dtype, deterministic):
    rng = np.random.default_rng(hash((nq, nk, causal, d, dtype, deterministic, "bwd")) % 2**32)
    q, k, v = random_qkv(rng, 2, nq, nk, 3, d, dtype_of(dtype))
    dout, _, _ = random_qkv(rng, 2, nq, 1, 3, d, dtype_of(dtype))
    _, _, grads = _fwd_bwd(q, k, v, dout, causal, deterministic)
    _check(grads, q, k, v, dout, causal)


@pytest.mark.parametrize("d", [64, 128])
def test_every_backward_config(d):
    from cuflash import device, families

    smem = device.query(0).smem_optin
    rng = np.random.default_rng(d + 1)
    for nq, nk, causal in ((200, 333, True), (129, 70, True), (257, 190, False)):
        q, k, v = random_qkv(rng, 1, nq, nk, 2, d, dtype_of("bfloat16"))
        dout, _, _ = random_qkv(rng, 1, nq, 1, 2, d, dtype_of("bfloat16"))
        for cfg in families.BWD.space(d, smem):
            _, _, grads = _fwd_bwd(q, k, v, dout, causal, config=cfg)
            _check(grads, q, k, v, dout, causal, f" {cfg} {(nq, nk, causal)}")
        for cfg in families.BWD_DQ.space(d, smem):
            _, _, grads = _fwd_bwd(q, k, v, dout, causal, deterministic=True, dq_config=cfg)
            _check(grads, q, k, v, dout, causal, f" {cfg} {(nq, nk, causal)}")


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_is_bitwise_reproducible(causal):
    import cupy

    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 2, 1031, 1031, 4, 128, dtype_of("bfloat16"))
    dout, _, _ = random_qkv(rng, 2, 1031, 1, 4, 128, dtype_of("bfloat16"))
    _, _, first = _fwd_bwd(q, k, v, dout, causal, deterministic=True)
    for _ in range(5):
        _, _, again = _fwd_bwd(q, k, v, dout, causal, deterministic=True)
        for a, b in zip(first, again):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
    # the atomic path agrees with it to rounding (the Hopper kernel's deterministic mode sums dK and
    # dV over the query blocks in another order too, so none of the three is compared bitwise)
    _, _, fast = _fwd_bwd(q, k, v, dout, causal, deterministic=False)
    for a, b in zip(fast, first):
        assert float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max()) < 2e-2


def test_backward_strided_inputs_match_contiguous():
    """q, k, v slices of one packed (b, n, 3, h, d) array; dout a transposed view."""
    import cupy

    rng = np.random.default_rng(3)
    b, n, h, d = 2, 300, 4, 64
    qkv = cupy.asarray(rng.standard_normal((b, n, 3, h, d)).astype(np.float32)).astype(dtype_of("bfloat16"))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout_t = cupy.asarray(rng.standard_normal((b, h, n, d)).astype(np.float32)).astype(q.dtype)
    dout = dout_t.transpose(0, 2, 1, 3)
    _, _, g1 = _fwd_bwd(q, k, v, dout, True, deterministic=True)
    _, _, g2 = _fwd_bwd(*(cupy.ascontiguousarray(x) for x in (q, k, v, dout)), True, deterministic=True)
    for a, c in zip(g1, g2):
        assert bool((a.view(cupy.uint16) == c.view(cupy.uint16)).all())


def test_large_logits_backward():
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 257, 257, 2, 128, dtype_of("float16"), scale=4.0)
    dout, _, _ = random_qkv(rng, 1, 257, 1, 2, 128, dtype_of("float16"))
    for causal in (False, True):
        _, _, grads = _fwd_bwd(q, k, v, dout, causal)
        _check(grads, q, k, v, dout, causal, " (large logits)")


def _sm90_unavailable() -> str | None:
    from cuflash import device

    props = device.query(0)
    return None if tuple(props.cc) == (9, 0) else f"the sm90 backward needs cc 9.0, this GPU is {props.cc_str}"


def _sm90_case(nq, nk, causal, d, dtype, tag):
    """(q, k, v, dout, out, lse) of a fresh seeded case for the Hopper backward (skipped off cc 9.0)."""
    from cuflash import _forward

    why = _sm90_unavailable()
    if why:
        pytest.skip(why)
    rng = np.random.default_rng(hash((nq, nk, causal, d, dtype, tag)) % 2**32)
    q, k, v = random_qkv(rng, 2, nq, nk, 3, d, dtype_of(dtype))
    dout, _, _ = random_qkv(rng, 2, nq, 1, 3, d, dtype_of(dtype))
    return (q, k, v, dout, *_forward.forward(q, k, v, causal=causal))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SEQLEN_PAIRS)
def test_sm90_backward_matches_reference(nq, nk, causal, d, dtype):
    """The Hopper backward (opt-in: backend="sm90") on the same matrix, outputs poisoned by the plan
    (fresh buffers) and checked by the 2x rule."""
    from cuflash import _backward

    q, k, v, dout, out, lse = _sm90_case(nq, nk, causal, d, dtype, "bwd90")
    grads = _backward.backward(dout, q, k, v, out, lse, causal=causal, backend="sm90")
    _check(grads, q, k, v, dout, causal, " (sm90)")


@pytest.mark.parametrize("dq_bulk", [0, 1, 2, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_each_sm90_dq_path_matches_reference(d, dq_bulk):
    """Each way the Hopper backward adds dQ (atomics; a store warp's row reductions; fragment-order
    blocks reduced by the consumers or by the store warp), forced as the tile, causal and not, odd
    lengths, by the 2x rule."""
    from cuflash import _backward
    from cuflash.tiles import Sm90BwdConfig

    tile = Sm90BwdConfig(d, 64, 2, 2, dq_bulk, 1)
    for nq, nk, causal in ((333, 555, False), (1031, 517, True)):
        q, k, v, dout, out, lse = _sm90_case(nq, nk, causal, d, "bfloat16", f"dqb{dq_bulk}")
        grads = _backward.backward(dout, q, k, v, out, lse, causal=causal, config=tile, backend="sm90")
        _check(grads, q, k, v, dout, causal, f" (sm90 dq_bulk {dq_bulk})")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(1, 1), (113, 203), (203, 113), (256, 256), (1000, 1000), (1031, 517)])
@pytest.mark.parametrize("dq_bulk", [0, 4])
def test_split_head_dim_dq_paths_match_reference(dq_bulk, nq, nk, causal, dtype):
    """The split-head-dim tile's two ways of adding dQ (head_dim 256): per-element atomics, and its
    blocks staged over the query block's own Q / dO images for the store warp's bulk reductions
    (Sm90BwdTraits::kDqInStage), forced as the tile, by the 2x rule."""
    from cuflash import _backward
    from cuflash.tiles import Sm90BwdConfig

    q, k, v, dout, out, lse = _sm90_case(nq, nk, causal, 256, dtype, f"splitd{dq_bulk}")
    grads = _backward.backward(dout, q, k, v, out, lse, causal=causal, config=Sm90BwdConfig(256, 64, 2, 2, dq_bulk, 0),
                               backend="sm90")
    _check(grads, q, k, v, dout, causal, f" (sm90 d256 dq_bulk {dq_bulk})")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(1, 1), (113, 203), (203, 113), (256, 256), (1000, 1000), (1031, 517)])
def test_sm90_deterministic_backward_matches_reference_and_repeats_bitwise(nq, nk, causal, d, dtype):
    """The Hopper backward's deterministic mode (dQ's block reductions in key-block order behind
    turn counters): the 2x rule and three runs bitwise equal. dK and dV are not compared bitwise
    with the atomic mode's: this mode walks the query blocks from the last, so their fp32 sums
    round in another order (the 2x rule holds for both)."""
    import cupy
    from cuflash import _backward

    q, k, v, dout, out, lse = _sm90_case(nq, nk, causal, d, dtype, "bwd90det")
    run = lambda det: _backward.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, backend="sm90")
    first = run(True)
    _check(first, q, k, v, dout, causal, " (sm90 deterministic)")
    for _ in range(2):
        for a, b in zip(first, run(True)):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


def _feature_case(kw, seed, nq, nk, d):
    """(q, k, v, dout, out, lse, kw) of a bf16 case with 4 query heads for a feature test (skipped
    off cc 9.0): kw's "gqa" (one k/v head) and "alibi" (random slopes) turned into the call's own."""
    import cupy
    from cuflash import _forward

    why = _sm90_unavailable()
    if why:
        pytest.skip(why)
    kw = dict(kw)
    rng = np.random.default_rng(seed)
    hkv = 1 if kw.pop("gqa", False) else 4
    q, _, _ = random_qkv(rng, 2, nq, 1, 4, d, dtype_of("bfloat16"))
    _, k, v = random_qkv(rng, 2, 1, nk, hkv, d, dtype_of("bfloat16"))
    dout, _, _ = random_qkv(rng, 2, nq, 1, 4, d, dtype_of("bfloat16"))
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, 4), dtype=cupy.float32)
    return (q, k, v, dout, *_forward.forward(q, k, v, **kw), kw)


def _assert_close_to(grads, ref, check_nan=False):
    """dq, dk, dv within 2% of the reference gradients' largest magnitude."""
    import cupy

    for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
        a32, b32 = a.astype(cupy.float32), b.astype(cupy.float32)
        if check_nan:
            assert not bool(cupy.isnan(a32).any()), name
        scale = float(cupy.abs(b32).max()) or 1.0
        assert float(cupy.abs(a32 - b32).max()) <= 2e-2 * scale, name


@pytest.mark.parametrize("kw", [dict(window_size=(100, 20)), dict(causal=True, window_size=(300, 0)),
                                dict(causal=True, softcap=5.0), dict(alibi=True), dict(dropout_p=0.2, seed=9),
                                dict(gqa=True, causal=True), dict(causal=True, softcap=5.0, dropout_p=0.1, seed=3,
                                                                  window_size=(200, 0))], ids=str)
@pytest.mark.parametrize("dq_bulk", [0, 4])
def test_split_head_dim_sm90_backward_with_features(kw, dq_bulk):
    """The split-head-dim tile (head_dim 256, forced here with each dq path, whatever the automatic choice) with windows,
    softcap, ALiBi, dropout and GQA against the sm80 backward of the same call (dropout: the same
    Philox keep mask in both), and its plain case by the 2x rule in test_sm90_backward_matches_reference."""
    from cuflash import _backward
    from cuflash.tiles import Sm90BwdConfig

    q, k, v, dout, out, lse, kw = _feature_case(kw, 13, 700, 555, 256)
    ours = _backward.backward(dout, q, k, v, out, lse, backend="sm90", config=Sm90BwdConfig(256, 64, 2, 2, dq_bulk, 0), **kw)
    ref = _backward.backward(dout, q, k, v, out, lse, backend="sm80", **kw)
    _assert_close_to(ours, ref, check_nan=True)


@pytest.mark.parametrize("kw", [dict(window_size=(100, 20)), dict(causal=True, window_size=(300, 0)),
                                dict(causal=True, softcap=5.0), dict(alibi=True), dict(dropout_p=0.2, seed=9),
                                dict(gqa=True, causal=True)], ids=str)
def test_sm90_deterministic_backward_with_features(kw):
    """Windows (the turn's rank counts from the first key block that sees the query block), softcap,
    ALiBi, dropout and GQA in the deterministic mode: repeatable bitwise and within the sm80
    deterministic backward's reach (both by the 2x rule where the reference has the feature)."""
    import cupy
    from cuflash import _backward

    q, k, v, dout, out, lse, kw = _feature_case(kw, 11, 1500, 1300, 128)
    run = lambda backend: _backward.backward(dout, q, k, v, out, lse, deterministic=True, backend=backend, **kw)
    first = run("sm90")
    for a, b in zip(first, run("sm90")):
        assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
    _assert_close_to(first, run("sm80"))


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_deterministic_varlen_is_bitwise_and_agrees_with_sm80(causal):
    """The Hopper deterministic mode on variable-length batches: each sequence takes its own order
    (rotated, or the staircase where it has more key blocks than query blocks, unmasked): bitwise
    the same over runs, and the sm80 deterministic backward's gradients to rounding."""
    import cupy
    from cuflash import varlen

    why = _sm90_unavailable()
    if why:
        pytest.skip(why)
    rng = np.random.default_rng(11 + causal)
    lens_q, lens_k = [700, 1, 300, 0, 1200, 64], [200, 129, 900, 50, 1200, 64]
    dt = dtype_of("bfloat16")
    q, dout = (cupy.asarray(rng.standard_normal((sum(lens_q), 4, 64)), dtype=cupy.float32).astype(dt) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((sum(lens_k), 2, 64)), dtype=cupy.float32).astype(dt) for _ in range(2))
    cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(x)]), dtype=cupy.int32) for x in (lens_q, lens_k))
    mq, mk = max(lens_q), max(lens_k)
    out, lse = varlen.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_lse=True)
    run = lambda backend: varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal=causal,
                                                           deterministic=True, backend=backend)
    first = run("sm90")
    for a, b in zip(first, run("sm90")):
        assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
    for name, a, b in zip(("dq", "dk", "dv"), first, run("sm80")):
        a32, b32 = a.astype(cupy.float32), b.astype(cupy.float32)
        assert not bool(cupy.isnan(a32).any()), name
        scale = float(cupy.abs(b32).max()) or 1.0
        assert float(cupy.abs(a32 - b32).max()) <= 2e-2 * scale, name
