"""ALiBi (issue 13) on the GPU: the forward and the backward (sm80 and sm90), with slopes per head
and per (batch, head), causal and not, windows, both alignments, softcap, GQA, ragged seqlens, both
dtypes, head dims 64, 128 and 256, against the float64 reference with FlashAttention's 2x rule
(cuflash.testing's oracles add the same bias). Outputs poisoned before each launch. Slopes are
large enough that the plain attention's output is far off, so a bias the kernel dropped or
misplaced fails."""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule, naive, random_qkv
from tests.gpu.test_forward_gpu import backend  # noqa: F401  (the fixture: every forward backend of the GPU)

pytestmark = pytest.mark.gpu

# (seqlen_q, seqlen_k, causal, window_size, alignment, softcap, slopes per batch)
CASES = [
    (256, 256, False, (-1, -1), "bottom_right", 0.0, False), (256, 256, True, (-1, -1), "bottom_right", 0.0, True),
    (113, 203, True, (-1, -1), "bottom_right", 0.0, False), (203, 113, False, (-1, -1), "bottom_right", 0.0, True),
    (1, 239, False, (-1, -1), "bottom_right", 0.0, False), (1000, 1000, True, (64, 0), "bottom_right", 0.0, False),
    (300, 517, False, (100, 7), "bottom_right", 0.0, True), (129, 64, True, (-1, -1), "top_left", 0.0, False),
    (177, 300, False, (-1, -1), "top_left", 0.0, True), (256, 256, True, (-1, -1), "bottom_right", 5.0, True),
]


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


def _slopes(rng, b, h, per_batch):
    """FlashAttention-style slopes (a geometric series per head) times a random factor per batch and
    head, float32 on the device: from ~0.02 to ~0.7 per key of distance."""
    import cupy

    base = 2.0 ** (-8.0 * np.arange(1, h + 1) / h) * 1.4
    s = base * rng.uniform(0.5, 1.0, (b, h)) if per_batch else base
    return cupy.asarray(np.asarray(s, dtype=np.float32))


def _poisoned(q, **kw):
    import cupy
    from cuflash import _forward

    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
    return _forward.forward(q, out=out, lse=lse, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("nq,nk,causal,window,alignment,softcap,per_batch", CASES)
def test_alibi_forward(nq, nk, causal, window, alignment, softcap, per_batch, d, dtype, backend):  # noqa: F811
    import cupy

    case = (nq, nk, causal, window, alignment, softcap, per_batch, d, dtype, backend)
    rng = np.random.default_rng(_seed(*case))
    b, h, h_kv = 2, 4, 2  # GQA: two query heads per k/v head
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of(dtype), heads_kv=h_kv)
    slopes = _slopes(rng, b, h, per_batch)
    mask = MaskOptions.of(causal=causal, window_size=window, alignment=alignment, softcap=softcap)
    out, lse = _poisoned(q, k=k, v=v, mask=mask, alibi_slopes=slopes, backend=backend)
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any()) and not bool(cupy.isnan(lse).any())
    scale = 1 / math.sqrt(d)
    err, pt, allowed = fa_rule(out, q, k, v, mask, scale, alibi_slopes=slopes)
    assert err <= allowed, f"max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
    _, lse_ref = naive(q, k, v, mask, scale, cupy.float64, alibi_slopes=slopes)
    finite = cupy.isfinite(lse_ref)
    assert bool((cupy.isfinite(lse) == finite).all())
    if bool(finite.any()):
        assert float(cupy.abs(lse.astype(cupy.float64) - lse_ref)[finite].max()) < 2e-3
    if nk > 8:  # the bias matters: the plain attention's output is far from it
        err_plain, _, _ = fa_rule(out, q, k, v, mask, scale)
        assert err_plain > 4 * allowed


def test_zero_slopes_give_the_plain_forward_bits():
    """slope 0 adds 0 to every score: the ALiBi instance computes the plain forward's bits."""
    import cupy
    from cuflash import _forward

    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 2, 200, 333, 4, 128, dtype_of("bfloat16"))
    mask = MaskOptions.of(causal=True)
    plain, plain_lse = _forward.forward(q, k, v, mask=mask, backend="sm80")
    out, lse = _forward.forward(q, k, v, mask=mask, alibi_slopes=cupy.zeros(4, cupy.float32))
    assert bool((out.view(cupy.uint16) == plain.view(cupy.uint16)).all())
    assert bool((lse == plain_lse).all())


def test_repeated_calls_read_each_calls_slopes():
    """The plan is cached per signature; the slopes pointer is an input of each call."""
    import cupy
    from cuflash import _forward

    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 1, 128, 128, 2, 64, dtype_of("float16"))
    mask = MaskOptions.of(causal=False)
    a = _forward.forward(q, k, v, mask=mask, alibi_slopes=cupy.asarray(np.float32([0.5, 0.1])))[0]
    b = _forward.forward(q, k, v, mask=mask, alibi_slopes=cupy.asarray(np.float32([0.1, 0.5])))[0]
    for out, s in ((a, [0.5, 0.1]), (b, [0.1, 0.5])):
        err, _, allowed = fa_rule(out, q, k, v, mask, 1 / 8, alibi_slopes=cupy.asarray(np.float32(s)))
        assert err <= allowed


def test_the_automatic_forward_takes_the_hopper_kernel_with_alibi():
    """backend=None with ALiBi on a cc 9.0 GPU runs the sm90 forward (the same bits as forcing it)."""
    import cupy
    from cuflash import _forward, device

    if device.query(0).cc != (9, 0):
        pytest.skip("the sm90 forward runs on compute capability 9.0 only")
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 2, 300, 300, 4, 128, dtype_of("bfloat16"))
    slopes = cupy.asarray(np.float32([0.5, 0.2, 0.1, 0.05]))
    auto = _forward.forward(q, k, v, causal=True, alibi_slopes=slopes)[0]
    forced = _forward.forward(q, k, v, causal=True, alibi_slopes=slopes, backend="sm90")[0]
    assert bool((auto.view(cupy.uint16) == forced.view(cupy.uint16)).all())


# The Hopper forward's d64 tiles, across both forms of its bias (kernels_cu/sm90/fwd.cuh kAlibiSplit:
# split into a column part per score and a row part through the row max, or, on three consumers with
# softcap (the case with 5.0 below), dropout or varlen + window, the whole bias per score).
# (block_k, consumers, pingpong, q_stages)
HOPPER_D64_TILES = [(128, 3, 1, 1), (128, 3, 0, 2), (96, 3, 1, 1), (96, 3, 1, 2), (128, 2, 0, 2), (128, 2, 1, 1)]


@pytest.mark.parametrize("tile", HOPPER_D64_TILES, ids=lambda t: "bk{}c{}pp{}q{}".format(*t))
@pytest.mark.parametrize("nq,nk,causal,window,alignment,softcap,per_batch",
                         [CASES[1], CASES[3], CASES[5], CASES[6], CASES[9],
                          (700, 1500, False, (-1, -1), "bottom_right", 0.0, False),
                          (1500, 700, True, (-1, -1), "top_left", 0.0, True)])
def test_alibi_forward_on_each_hopper_d64_tile(nq, nk, causal, window, alignment, softcap, per_batch, tile):
    """Each d64 tile of the sm90 forward, named explicitly (the automatic choice takes one per shape),
    with blocks left of, right of and across the diagonals, against the float64 reference."""
    import cupy
    from cuflash import device
    from cuflash.tiles import Sm90FwdConfig

    if device.query(0).cc != (9, 0):
        pytest.skip("the sm90 forward runs on compute capability 9.0 only")
    case = (nq, nk, causal, window, alignment, softcap, per_batch, tile)
    rng = np.random.default_rng(_seed(*case))
    q, k, v = random_qkv(rng, 2, nq, nk, 4, 64, dtype_of("bfloat16"), heads_kv=2)
    slopes = _slopes(rng, 2, 4, per_batch)
    mask = MaskOptions.of(causal=causal, window_size=window, alignment=alignment, softcap=softcap)
    cfg = Sm90FwdConfig(head_dim=64, block_k=tile[0], consumers=tile[1], stages=2, pingpong=tile[2], overlap=1,
                        q_stages=tile[3], persistent=1)
    out, lse = _poisoned(q, k=k, v=v, mask=mask, alibi_slopes=slopes, config=cfg)
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any())
    err, pt, allowed = fa_rule(out, q, k, v, mask, 1 / 8, alibi_slopes=slopes)
    assert err <= allowed, f"max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
    _, lse_ref = naive(q, k, v, mask, 1 / 8, cupy.float64, alibi_slopes=slopes)
    finite = cupy.isfinite(lse_ref)
    assert bool((cupy.isfinite(lse) == finite).all())
    assert float(cupy.abs(lse.astype(cupy.float64) - lse_ref)[finite].max()) < 2e-3


# (seqlen_q, seqlen_k, causal, window_size, alignment, softcap, slopes per batch)
BWD_CASES = [CASES[0], CASES[1], CASES[2], CASES[3], CASES[5], CASES[6], CASES[7], CASES[9]]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype,d", [("bfloat16", 64), ("float16", 128), ("bfloat16", 128), ("bfloat16", 256)])
@pytest.mark.parametrize("nq,nk,causal,window,alignment,softcap,per_batch", BWD_CASES)
def test_alibi_backward(nq, nk, causal, window, alignment, softcap, per_batch, dtype, d, deterministic):
    """dq, dk, dv through the ALiBi forward's out and lse, both dQ paths (atomics, deterministic
    kernel), GQA, against the float64 reference with the 2x rule; the public entry points agree."""
    import cupy
    import cuflash
    from cuflash import _backward, _forward
    from cuflash.testing import fa_rule_grads

    case = (nq, nk, causal, window, alignment, softcap, per_batch, d, dtype, deterministic, "bwd")
    rng = np.random.default_rng(_seed(*case))
    b, h, h_kv = 2, 4, 2
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of(dtype), heads_kv=h_kv)
    dout, _, _ = random_qkv(rng, b, nq, 1, h, d, dtype_of(dtype))
    slopes = _slopes(rng, b, h, per_batch)
    mask = MaskOptions.of(causal=causal, window_size=window, alignment=alignment, softcap=softcap)
    out, lse = _forward.forward(q, k, v, mask=mask, alibi_slopes=slopes)
    grads = _backward.backward(dout, q, k, v, out, lse, mask=mask, deterministic=deterministic, alibi_slopes=slopes)
    for g in grads:
        assert not bool(cupy.isnan(g.astype(cupy.float32)).any())
    scale = 1 / math.sqrt(d)
    for name, (err, pt, allowed) in fa_rule_grads(grads, q, k, v, dout, mask, scale, alibi_slopes=slopes).items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
    api = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, window_size=window, alignment=alignment,
                                     softcap=softcap, deterministic=deterministic, alibi_slopes=slopes)
    if deterministic:
        for a, g in zip(api, grads):
            assert bool((a.view(cupy.uint16) == g.view(cupy.uint16)).all())


def test_public_forward_takes_alibi_and_refuses_v1():
    import cupy
    import cuflash

    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 2, 64, 96, 2, 64, dtype_of("bfloat16"))
    slopes = cupy.asarray(np.float32([0.3, 0.05]))
    out, lse = cuflash.attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True)
    err, _, allowed = fa_rule(out, q, k, v, True, 1 / 8, alibi_slopes=slopes)
    assert err <= allowed
    with pytest.raises(ValueError, match="v1 algorithm has no ALiBi"):
        cuflash.attention(q, k, v, alibi_slopes=slopes, algorithm="v1")
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        cuflash.attention(q, k, v, alibi_slopes=slopes.astype(cupy.float16))


@pytest.mark.parametrize("with_sinks", [False, True])
def test_torch_autograd_matches_the_cupy_passes(with_sinks):
    """torch tensors: cuflash.attention(..., alibi_slopes=) is differentiable in q, k, v (and the
    sinks), with the bits of the CuPy forward and backward (the same kernels, fed through DLPack)."""
    torch = pytest.importorskip("torch")
    import cupy
    import cuflash

    torch.manual_seed(3)
    b, n, h, h_kv, d = 2, 200, 4, 2, 128
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(b, n + 37, h_kv, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in "kv")
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
    sinks = torch.randn(h, device="cuda", requires_grad=True) if with_sinks else None
    out = cuflash.attention(q, k, v, causal=True, alibi_slopes=slopes, sinks=sinks)
    dout = torch.randn_like(out)
    out.backward(dout)
    cq, ck, cv, cs, cd = (cupy.from_dlpack(x.detach()) for x in (q, k, v, slopes, dout))
    if with_sinks:
        assert sinks.grad is not None and bool(torch.isfinite(sinks.grad).all())
        return  # the rescaled out and its gradients are the sinks tests' subject; here: it runs
    ref, lse = cuflash.attention(cq, ck, cv, causal=True, alibi_slopes=cs, return_lse=True)
    assert bool((cupy.from_dlpack(out.detach()).view(cupy.uint16) == ref.view(cupy.uint16)).all())
    dq, dk, dv = cuflash.attention_backward(cd, cq, ck, cv, ref, lse, causal=True, alibi_slopes=cs,
                                            deterministic=True)
    # torch's backward sums dQ with atomics: the same values up to the order of fp32 additions
    for t, c in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
        c = c.astype(cupy.float32)
        diff = float(cupy.abs(cupy.from_dlpack(t).astype(cupy.float32) - c).max())
        assert diff <= 1e-2 * max(float(cupy.abs(c).max()), 1.0), diff


@pytest.mark.parametrize("backend_bwd", ["sm80", "sm90"])
@pytest.mark.parametrize("nq,nk,causal,window,alignment,softcap,per_batch", [CASES[1], CASES[3], CASES[6], CASES[9]])
def test_alibi_backward_on_each_backend(nq, nk, causal, window, alignment, softcap, per_batch, backend_bwd):
    """d128 bf16, atomic dQ: the sm80 and the Hopper dK/dV kernels (forced) both meet the 2x rule."""
    import cupy
    from cuflash import _backward, _forward
    from cuflash.testing import backend_unavailable, fa_rule_grads

    why = backend_unavailable(backend_bwd)
    if why:
        pytest.skip(f"{backend_bwd} not on this GPU: {why}")
    rng = np.random.default_rng(_seed(nq, nk, causal, window, alignment, softcap, per_batch, backend_bwd))
    q, k, v = random_qkv(rng, 2, nq, nk, 4, 128, dtype_of("bfloat16"), heads_kv=2)
    dout, _, _ = random_qkv(rng, 2, nq, 1, 4, 128, dtype_of("bfloat16"))
    slopes = _slopes(rng, 2, 4, per_batch)
    mask = MaskOptions.of(causal=causal, window_size=window, alignment=alignment, softcap=softcap)
    out, lse = _forward.forward(q, k, v, mask=mask, alibi_slopes=slopes)
    grads = _backward.backward(dout, q, k, v, out, lse, mask=mask, alibi_slopes=slopes, backend=backend_bwd)
    for name, (err, pt, allowed) in fa_rule_grads(grads, q, k, v, dout, mask, 1 / math.sqrt(128),
                                                  alibi_slopes=slopes).items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
    assert not any(bool(cupy.isnan(g.astype(cupy.float32)).any()) for g in grads)


@pytest.mark.parametrize("causal,per_batch", [(False, True), (True, False), (True, True)])
def test_alibi_variable_length_batches(causal, per_batch, backend):  # noqa: F811
    """attention_varlen(alibi_slopes=): each packed sequence against its own dense reference (its
    batch's slopes, bottom-right per sequence); the backward's gradients likewise."""
    import cupy
    from cuflash import varlen
    from cuflash.testing import fa_rule_grads

    rng = np.random.default_rng(_seed(causal, per_batch, backend, "varlen"))
    lens_q, lens_k, h, h_kv, d = [37, 200, 1, 129], [64, 150, 77, 300], 4, 2, 128
    dt = dtype_of("bfloat16")
    seqs = [random_qkv(rng, 1, nq, nk, h, d, dt, heads_kv=h_kv) for nq, nk in zip(lens_q, lens_k)]
    q, k, v = (cupy.concatenate([s[i][0] for s in seqs]) for i in range(3))
    cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(x)]).astype(np.int32)) for x in (lens_q, lens_k))
    slopes = _slopes(rng, len(lens_q), h, per_batch)
    mask = MaskOptions.of(causal=causal)
    out, lse = varlen.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                       alibi_slopes=slopes, return_lse=True, backend=backend)
    dout = cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32)).astype(out.dtype)
    grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                             causal=causal, alibi_slopes=slopes)
    scale = 1 / math.sqrt(d)
    for b in range(len(seqs)):
        i0, i1 = int(cu_q[b]), int(cu_q[b + 1])
        j0, j1 = int(cu_k[b]), int(cu_k[b + 1])
        s_b = slopes[b] if per_batch else slopes
        one = lambda x, a, z: x[a:z][None]  # noqa: E731  (the sequence as a batch of one)
        qb, kb, vb = one(q, i0, i1), one(k, j0, j1), one(v, j0, j1)
        err, pt, allowed = fa_rule(one(out, i0, i1), qb, kb, vb, mask, scale, alibi_slopes=s_b)
        assert err <= allowed, f"sequence {b}: {err:.3e} > {allowed:.3e}"
        g = (one(grads[0], i0, i1), one(grads[1], j0, j1), one(grads[2], j0, j1))
        for name, (err, pt, allowed) in fa_rule_grads(g, qb, kb, vb, one(dout, i0, i1), mask, scale,
                                                      alibi_slopes=s_b).items():
            assert err <= allowed, f"sequence {b} {name}: {err:.3e} > {allowed:.3e}"
