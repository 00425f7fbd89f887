"""Fused dropout on the GPU (issue 5): the kernels' mask is cuflash.philox's bit for bit, and outputs and
gradients meet FlashAttention's 2x rule against the float64 oracle given that same mask.

The mask is read back from the kernels themselves: with v[j] = e_(j - j0) for the keys j of a window
[j0, j0 + head_dim) and 0 elsewhere, out[b, i, h, c] = P[i, j0 + c] * Z[i, j0 + c], nonzero exactly
where key j0 + c is kept for row i (q and k are small, so no P underflows).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash.philox import dropout_keep_mask, dropout_scale, dropout_threshold
from cuflash.reference import causal_mask
from cuflash.testing import backend_unavailable, dtype_of, fa_rule, fa_rule_grads, naive, random_qkv

pytestmark = pytest.mark.gpu
# "v2@sm80", "v2@sm90": the v2 forward on a forced backend (skipped where the GPU has none); "v2"
# is the automatic choice (sm90 on a cc 9.0 GPU)
ALGORITHMS = ["v1", "v2", "v2@sm80", "v2@sm90"]


def _algo(algorithm) -> dict:
    """attention()'s keywords for an ALGORITHMS entry; skips the test where its backend cannot run."""
    name, _, backend = algorithm.partition("@")
    if backend:
        why = backend_unavailable(backend)
        if why:
            pytest.skip(f"{backend} forward not on this GPU: {why}")
        return {"algorithm": name, "backend": backend}
    return {"algorithm": name}

SEEDS = [12345, 2**64 - 2**31 + 7]  # the second has both key words nonzero and its top bit set


def _same_bits(a, b) -> bool:
    import cupy

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = cupy.ascontiguousarray(a), cupy.ascontiguousarray(b)
    return bool((a.view(cupy.uint8) == b.view(cupy.uint8)).all())


def _keep_scale(seed, b, h, nq, nk, p):
    """Z = keep_mask * dropout_scale(p) as a float64 CuPy array (b, h, nq, nk), for the oracles."""
    import cupy

    return cupy.asarray(dropout_keep_mask(seed, b, h, nq, nk, p).astype(np.float64) * dropout_scale(p))


def _recover_mask(q, k, p, seed, causal=False, algorithm="v2"):
    """The kernel's keep mask (b, h, nq, nk) as a NumPy bool array, one head_dim-wide key window per call."""
    import cupy
    import cuflash

    b, nq, h, d = q.shape
    nk = k.shape[1]
    kept = np.zeros((b, h, nq, nk), dtype=bool)
    for j0 in range(0, nk, d):
        w = min(d, nk - j0)
        vn = np.zeros((b, nk, h, d), dtype=np.float32)
        vn[:, j0:j0 + w, :, :w] = np.eye(w, dtype=np.float32)[None, :, None, :]
        v = cupy.asarray(vn).astype(q.dtype)
        out = cuflash.attention(q, k, v, causal=causal, dropout_p=p, seed=seed, **_algo(algorithm))
        nonzero = cupy.asnumpy(out.astype(cupy.float32) != 0)  # (b, nq, h, d)
        assert not nonzero[..., w:].any()
        kept[..., j0:j0 + w] = nonzero[..., :w].transpose(0, 2, 1, 3)
    return kept


def _assert_masks_equal(got, want, what):
    bad = np.argwhere(got != want)
    assert len(bad) == 0, (f"{what}: {len(bad)} of {got.size} mask bits differ from cuflash.philox, first "
                           f"(b, h, i, j): {[tuple(map(int, x)) for x in bad[:8]]}")


# ------------------------------------------------------------------------------ (a), (b) the mask itself


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype,d,causal", [("bfloat16", 64, False), ("float16", 128, True)])
def test_mask_recovered_bit_for_bit(algorithm, dtype, d, causal):
    b, h, nq, nk, p = 2, 3, 77, 2 * d + 40, 0.3  # odd seqlen_q; three key windows, the last partial
    rng = np.random.default_rng(d + causal)
    q, k, _ = random_qkv(rng, b, nq, nk, h, d, dtype_of(dtype), scale=0.3)
    masks = []
    for seed in SEEDS:
        got = _recover_mask(q, k, p, seed, causal=causal, algorithm=algorithm)
        want = dropout_keep_mask(seed, b, h, nq, nk, p)
        if causal:
            want &= causal_mask(nq, nk)
        _assert_masks_equal(got, want, f"{algorithm} {dtype} d={d} causal={causal} seed={seed}")
        masks.append(got)
    assert (masks[0] != masks[1]).any()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction(p):
    b, h, nq, d = 4, 8, 1024, 64
    rng = np.random.default_rng(int(p * 100))
    q, k, _ = random_qkv(rng, b, nq, d, h, d, dtype_of("bfloat16"), scale=0.3)
    got = _recover_mask(q, k, p, seed=987654321)
    keep = 1 - dropout_threshold(p) / 65536
    sigma = math.sqrt(keep * (1 - keep) / got.size)
    assert abs(got.mean() - keep) <= 5 * sigma, f"kept {got.mean():.5f}, expected {keep:.5f} +- {sigma:.1e}"
    _assert_masks_equal(got, dropout_keep_mask(987654321, b, h, nq, d, p), f"p={p}")


# ------------------------------------------------------------------------------ (c) forward accuracy

FWD_CASES = [  # (algorithm, dtype, d, nq, nk, causal, p)
    ("v2", "bfloat16", 64, 113, 203, True, 0.17),
    ("v2", "bfloat16", 128, 256, 256, False, 0.5),
    ("v2", "float16", 64, 255, 255, False, 0.1),
    ("v2", "float16", 128, 203, 113, True, 0.17),
    ("v1", "bfloat16", 64, 200, 200, True, 0.5),
    ("v1", "bfloat16", 128, 77, 300, False, 0.17),
    ("v1", "float16", 64, 130, 65, True, 0.3),
    ("v1", "float16", 128, 128, 217, True, 0.1),
    ("v2@sm80", "bfloat16", 128, 256, 256, False, 0.5),
    ("v2@sm80", "float16", 64, 113, 203, True, 0.17),
    ("v2@sm90", "bfloat16", 64, 113, 203, True, 0.17),
    ("v2@sm90", "float16", 128, 203, 113, True, 0.17),
    ("v2@sm90", "bfloat16", 128, 1000, 1000, False, 0.1),
]


@pytest.mark.parametrize("algorithm,dtype,d,nq,nk,causal,p", FWD_CASES)
def test_forward_matches_reference(algorithm, dtype, d, nq, nk, causal, p):
    import cupy
    import cuflash

    b, h, seed = 2, 3, 2024 + nq
    rng = np.random.default_rng(nq * 1000 + nk)
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of(dtype))
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, dropout_p=p, seed=seed,
                                 **_algo(algorithm))
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == cupy.float32
    assert lse.shape == (b, h, nq)
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any())
    scale = 1 / math.sqrt(d)
    z = _keep_scale(seed, b, h, nq, nk, p)
    err, pt_err, allowed = fa_rule(out, q, k, v, causal, scale, keep_scale=z)
    assert err <= allowed, f"max err {err:.3e} > allowed {allowed:.3e} (same-dtype err {pt_err:.3e})"
    # the mask really acts: without it the same output is far off
    err_nomask, _, _ = fa_rule(out, q, k, v, causal, scale)
    assert err_nomask > 4 * allowed
    # lse is that of the undropped scores
    _, lse_ref = naive(q, k, v, causal, scale, cupy.float64)
    finite = cupy.isfinite(lse_ref)
    assert bool((cupy.isfinite(lse) == finite).all()), "lse -inf pattern differs from reference"
    if bool(finite.any()):
        assert float(cupy.abs(lse.astype(cupy.float64) - lse_ref)[finite].max()) < 1e-3
    _, lse_plain = cuflash.attention(q, k, v, causal=causal, return_lse=True, **_algo(algorithm))
    assert float(cupy.where(finite, cupy.abs(lse - lse_plain), 0).max()) <= 1e-5
    if causal and nq > nk:  # rows that see no key: exactly 0
        assert bool((out[:, : nq - nk].astype(cupy.float32) == 0).all())


# ------------------------------------------------------------------------------ (d) backward accuracy

BWD_CASES = [  # (dtype, d, nq, nk, causal, p)
    ("bfloat16", 64, 113, 203, True, 0.17),
    ("float16", 128, 203, 113, True, 0.5),
    ("bfloat16", 128, 256, 256, False, 0.1),
    ("float16", 64, 77, 130, False, 0.3),
]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype,d,nq,nk,causal,p", BWD_CASES)
def test_backward_matches_reference(dtype, d, nq, nk, causal, p, deterministic):
    import cupy
    import cuflash

    b, h, seed = 2, 3, 77 + nk
    rng = np.random.default_rng(nq * 1000 + nk + 1)
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of(dtype))
    dout, _, _ = random_qkv(rng, b, nq, 1, h, d, dtype_of(dtype))
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, dropout_p=p, seed=seed)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                       dropout_p=p, seed=seed)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert not bool(cupy.isnan(g.astype(cupy.float32)).any())
    z = _keep_scale(seed, b, h, nq, nk, p)
    res = fa_rule_grads(grads, q, k, v, dout, causal, 1 / math.sqrt(d), keep_scale=z)
    for name, (err, pt_err, allowed) in res.items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt_err:.3e})"
    # a backward with another seed (another mask) is far off: the backward really uses its seed
    other = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                       dropout_p=p, seed=seed + 1)
    res = fa_rule_grads(other, q, k, v, dout, causal, 1 / math.sqrt(d), keep_scale=z)
    assert res["dv"][0] > 4 * res["dv"][2]


SM90_BWD_CASES = BWD_CASES + [("bfloat16", 128, 1000, 1000, False, 0.1), ("float16", 64, 517, 1000, True, 0.2),
                              ("bfloat16", 64, 1000, 333, True, 0.5)]


@pytest.mark.parametrize("dtype,d,nq,nk,causal,p", SM90_BWD_CASES)
def test_sm90_backward_matches_reference(dtype, d, nq, nk, causal, p):
    """The Hopper backward's dropout instances (the forward's Philox bits regenerated per block in the
    transposed view, P^T's dropped elements zeroed for dV after dS^T) by the 2x rule, forced; and the
    sm80 backward's gradients within the same rule."""
    import cupy
    from cuflash import _backward, _forward, device

    if tuple(device.query(0).cc) != (9, 0):
        pytest.skip("the sm90 backward needs cc 9.0")
    b, h, seed = 2, 3, 177 + nk
    rng = np.random.default_rng(nq * 1000 + nk + 2)
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of(dtype))
    dout, _, _ = random_qkv(rng, b, nq, 1, h, d, dtype_of(dtype))
    out, lse = _forward.forward(q, k, v, causal=causal, dropout_p=p, seed=seed)
    z = _keep_scale(seed, b, h, nq, nk, p)
    for backend in ("sm90", "sm80"):
        grads = _backward.backward(dout, q, k, v, out, lse, causal=causal, dropout_p=p, seed=seed, backend=backend)
        for g, x in zip(grads, (q, k, v)):
            assert g.shape == x.shape and g.dtype == x.dtype
            assert not bool(cupy.isnan(g.astype(cupy.float32)).any())
        res = fa_rule_grads(grads, q, k, v, dout, causal, 1 / math.sqrt(d), keep_scale=z)
        for name, (err, pt_err, allowed) in res.items():
            assert err <= allowed, f"{backend} {name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt_err:.3e})"


# ------------------------------------------------------------------------------ (e) seeds, (f) p = 0


@pytest.mark.parametrize("causal", [False, True])
def test_same_seed_same_bits_other_seed_differs(causal):
    import cupy
    import cuflash

    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 2, 300, 300, 4, 64, dtype_of("bfloat16"))
    dout, _, _ = random_qkv(rng, 2, 300, 1, 4, 64, dtype_of("bfloat16"))
    p, seed = 0.2, SEEDS[1]

    def run(s, algorithm="v2"):
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, algorithm=algorithm, dropout_p=p,
                                     seed=s)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                           dropout_p=p, seed=s)
        return (out, lse, *grads)

    first = run(seed)
    for _ in range(3):
        for a, b, name in zip(first, run(seed), ("out", "lse", "dq", "dk", "dv")):
            assert _same_bits(a, b), f"{name} differs between two runs with the same seed"
    others = {}
    for other in (seed + 1, seed - 2**32, seed ^ 2**63):  # low key word, high key word, top bit
        again = others[other] = run(other)
        for a, b, name in zip(first, again, ("out", "lse", "dq", "dk", "dv")):
            if name != "lse":
                assert not _same_bits(a, b), f"{name} is the same for seeds {seed} and {other}"
        assert _same_bits(first[1], again[1])  # lse does not depend on the mask
    # the atomic dQ path: the same mask, so the same gradients to rounding (the Hopper kernel's
    # deterministic mode sums dK, dV over the query blocks in another order too)
    out, lse = first[:2]
    fast = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=False, dropout_p=p,
                                      seed=seed)
    for a, b in zip(fast, first[2:]):
        a, b = a.astype(cupy.float32), b.astype(cupy.float32)
        assert float(cupy.abs(a - b).max()) <= 1e-2 * max(float(cupy.abs(b).max()), 1.0)
    # v1 with the same seed: the same mask, so v2's output to rounding (far closer than another seed's)
    v1 = cuflash.attention(q, k, v, causal=causal, algorithm="v1", dropout_p=p, seed=seed)
    f64 = lambda x: x.astype(cupy.float64)  # noqa: E731
    near = float(cupy.abs(f64(v1) - f64(out)).max())
    far = float(cupy.abs(f64(others[seed + 1][0]) - f64(out)).max())
    assert near < far / 10, f"v1 vs v2, same seed: {near:.3e}; v2 with another seed: {far:.3e}"


@pytest.mark.parametrize("algorithm", ["v1", "v2"])
def test_zero_dropout_is_bitwise_no_dropout(algorithm):
    import cuflash

    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, 2, 177, 250, 3, 128, dtype_of("float16"))
    dout, _, _ = random_qkv(rng, 2, 177, 1, 3, 128, dtype_of("float16"))
    for causal in (False, True):
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, algorithm=algorithm)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for p, seed in ((0.0, None), (0.0, 5), (0, 2**64 - 1), (1e-6, 5)):  # 1e-6: T = 0, nothing dropped
            o2, l2 = cuflash.attention(q, k, v, causal=causal, return_lse=True, algorithm=algorithm, dropout_p=p,
                                       seed=seed)
            assert _same_bits(o2, out) and _same_bits(l2, lse), (p, seed)
            g2 = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                            dropout_p=p, seed=seed)
            for a, b in zip(g2, grads):
                assert _same_bits(a, b), (p, seed)


def test_cupy_needs_a_seed():
    import cuflash

    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, 1, 32, 32, 1, 64, dtype_of("bfloat16"))
    for algorithm in ("v1", "v2"):
        with pytest.raises(ValueError, match="seed"):
            cuflash.attention(q, k, v, dropout_p=0.1, algorithm=algorithm)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="seed"):
        cuflash.attention_backward(out, q, k, v, out, lse, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        cuflash.attention(q, k, v, dropout_p=1.0, seed=1)
    with pytest.raises(ValueError, match="seed"):
        cuflash.attention(q, k, v, dropout_p=0.1, seed=-1)


# ------------------------------------------------------------------------------ (g) torch autograd


def _torch_qkv(torch, seed, b, nq, nk, h, d, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(n):
        return (torch.randn(b, n, h, d, device="cuda", generator=g) * scale).to(torch.bfloat16).requires_grad_(True)

    return mk(nq), mk(nk), mk(nk)


def _torch_same_bits(torch, a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8)))


@pytest.mark.parametrize("causal,nq,nk", [(False, 128, 128), (True, 150, 190)])
def test_torch_autograd_equals_attention_backward(causal, nq, nk):
    torch = pytest.importorskip("torch", reason="torch not installed: PyTorch integration not tested")
    import cuflash
    from cuflash import _interop

    b, h, d, p, seed = 2, 3, 64, 0.2, 4242 + nq
    q, k, v = _torch_qkv(torch, nq, b, nq, nk, h, d)
    dout = torch.randn(b, nq, h, d, device="cuda").to(torch.bfloat16)
    out = cuflash.attention(q, k, v, causal=causal, deterministic=True, dropout_p=p, seed=seed)
    assert out.requires_grad
    out.backward(dout)

    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out2, lse = cuflash.attention(qd, kd, vd, causal=causal, return_lse=True, dropout_p=p, seed=seed)
    assert _torch_same_bits(torch, out, out2)
    grads = cuflash.attention_backward(dout, qd, kd, vd, out2, lse, causal=causal, deterministic=True,
                                       dropout_p=p, seed=seed)
    for name, a, f in zip("qkv", (q.grad, k.grad, v.grad), grads):
        assert isinstance(f, torch.Tensor) and _torch_same_bits(torch, a, f), f"d{name}: autograd differs"

    cp = lambda t: _interop.to_cupy(t, _interop.TORCH)  # noqa: E731
    cout = cuflash.attention(cp(qd), cp(kd), cp(vd), causal=causal, dropout_p=p, seed=seed)
    assert _torch_same_bits(torch, out, torch.from_dlpack(cout))  # the CuPy path: the same mask and bits
    z = _keep_scale(seed, b, h, nq, nk, p)
    res = fa_rule_grads([cp(t.grad) for t in (q, k, v)], cp(qd), cp(kd), cp(vd), cp(dout), causal,
                        1 / math.sqrt(d), keep_scale=z)
    for name, (err, pt_err, allowed) in res.items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt_err:.3e})"


def test_torch_drawn_seed_reused_by_backward():
    """Without a seed, torch draws one from its CPU generator: reproducible under torch.manual_seed, and
    autograd's backward uses the forward's mask (read back from the output; v one-hot per key)."""
    torch = pytest.importorskip("torch", reason="torch not installed: PyTorch integration not tested")
    import cuflash
    from cuflash import _interop

    b, h, n, d, p = 2, 2, 96, 64, 0.25
    q, k, _ = _torch_qkv(torch, 3, b, n, d, h, d, scale=0.3)
    # v[b, j, h, c] = (j == c): out[b, i, h, j] != 0 iff key j is kept for row i
    v = torch.eye(d, device="cuda")[None, :, None, :].expand(b, d, h, d).to(torch.bfloat16).contiguous()
    v.requires_grad_(True)

    torch.manual_seed(11)
    out = cuflash.attention(q, k, v, dropout_p=p)
    torch.manual_seed(11)
    again = cuflash.attention(q.detach(), k.detach(), v.detach(), dropout_p=p)
    assert _torch_same_bits(torch, out, again)
    torch.manual_seed(12)
    assert not _torch_same_bits(torch, out, cuflash.attention(q.detach(), k.detach(), v.detach(), dropout_p=p))

    kept = (out.detach().float() != 0).permute(0, 2, 1, 3).cpu().numpy()  # (b, h, n, d = n_k)
    assert 0.6 < kept.mean() < 0.9
    dout = torch.randn(b, n, h, d, device="cuda").to(torch.bfloat16)
    out.backward(dout)
    cp = lambda t: _interop.to_cupy(t, _interop.TORCH)  # noqa: E731
    import cupy

    z = cupy.asarray(kept.astype(np.float64) * dropout_scale(p))
    res = fa_rule_grads([cp(t.grad) for t in (q, k, v)], cp(q.detach()), cp(k.detach()), cp(v.detach()), cp(dout),
                        False, 1 / math.sqrt(d), keep_scale=z)
    for name, (err, pt_err, allowed) in res.items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt_err:.3e})"
