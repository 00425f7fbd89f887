"""attention_varlen and its backward on the GPU (issue 12; NOT YET RUN): ragged batches (lengths 0,
1, 17, 113, 1000, ...), seqlen_q below and above seqlen_k per sequence, causal in both alignments,
windows, softcap, GQA, partial head dims, both dtypes, deterministic and not. Each sequence's rows
are checked by FlashAttention's 2x rule against the float64 reference on that sequence alone
(cuflash.testing.fa_rule / fa_rule_grads on its slices), and the forward against cuflash.attention
on the same slices. Outputs are poisoned (NaN) before the launch; the gradients come from pool
blocks filled with NaN (an element no kernel writes stays NaN)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import varlen
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule, fa_rule_grads
from tests.gpu.test_gqa_gpu import _poison_pool  # NaN-filled pool blocks (as test_headdims_gpu)

pytestmark = pytest.mark.gpu

RAGGED = {
    "ragged": ([17, 0, 113, 1, 1000, 64], [17, 5, 200, 1, 1000, 0]),
    "decode": ([1, 1, 1, 1], [300, 1, 0, 129]),
    "prefill": ([257, 31, 128], [257, 31, 128]),
    "q_longer": ([100, 65, 2], [30, 64, 1]),
}
MASKS = [dict(), dict(causal=True), dict(causal=True, alignment="top_left"), dict(window_size=(32, 8)),
         dict(causal=True, window_size=(50, -1)), dict(softcap=30.0), dict(causal=True, softcap=5.0)]


def _packed(rng, lens, h, d, dtype):
    import cupy

    total = int(sum(lens))
    return cupy.asarray(rng.standard_normal((total, h, d)).astype(np.float32)).astype(dtype)


def _cu(lens):
    import cupy

    return cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))


@pytest.mark.parametrize("backend", [None, "sm80"])  # None: the Hopper kernel on an H100/H200 (d 64/128/192/256)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128, 80])
@pytest.mark.parametrize("mask_kw", MASKS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()) or "none")
@pytest.mark.parametrize("case", sorted(RAGGED))
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2)])
def test_varlen_forward_matches_each_sequence(h, hk, case, mask_kw, d, dtype, backend):
    import cupy

    lens_q, lens_k = RAGGED[case]
    rng = np.random.default_rng(hash((h, hk, case, str(mask_kw), d, dtype)) % 2**32)
    dt = dtype_of(dtype)
    q, k, v = _packed(rng, lens_q, h, d, dt), _packed(rng, lens_k, hk, d, dt), _packed(rng, lens_k, hk, d, dt)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    mask = MaskOptions.of(**mask_kw)
    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(dt)
    lse = cupy.full((h, q.shape[0]), cupy.nan, dtype=cupy.float32)
    out, lse = varlen._forward_cupy(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), mask, None, out=out, lse=lse,
                                    backend=backend)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    scale = 1 / math.sqrt(d)
    oq, ok = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        rows = slice(int(oq[b]), int(oq[b + 1]))
        ob, lb = out[rows][None], lse[:, rows]
        assert not bool(cupy.isnan(ob.astype(cupy.float32)).any()) and not bool(cupy.isnan(lb).any()), b
        if nk == 0:
            assert bool((ob.astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lb).all()), b
            continue
        qb = q[rows][None]
        kb, vb = k[int(ok[b]):int(ok[b + 1])][None], v[int(ok[b]):int(ok[b + 1])][None]
        err, pt, allowed = fa_rule(ob, qb, kb, vb, mask, scale)
        assert err <= allowed, f"sequence {b} ({nq} x {nk}): max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
        import cuflash

        dense, dense_lse = cuflash.attention(qb, kb, vb, return_lse=True, backend="sm80", **mask_kw)
        diff = float(cupy.abs(ob.astype(cupy.float32) - dense.astype(cupy.float32)).max())
        assert diff <= allowed, f"sequence {b}: varlen and dense cuflash differ by {diff:.3e} > {allowed:.3e}"
        finite = cupy.isfinite(dense_lse[0])
        assert bool((cupy.isfinite(lb) == finite).all()), b
        assert float(cupy.abs(cupy.where(finite, lb - dense_lse[0], 0)).max()) <= 1e-3, b


def test_empty_batches_give_empty_or_filled_outputs():
    import cupy

    rng = np.random.default_rng(0)
    dt = dtype_of("bfloat16")
    q, k = _packed(rng, [5, 3], 2, 64, dt), _packed(rng, [0, 0], 2, 64, dt)
    out, lse = varlen.attention_varlen(q, k, k, _cu([5, 3]), _cu([0, 0]), 5, 0, return_lse=True)
    assert bool((out.astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse).all())
    q0 = _packed(rng, [0, 0], 2, 64, dt)
    out, lse = varlen.attention_varlen(q0, q0, q0, _cu([0, 0]), _cu([0, 0]), 0, 0, return_lse=True)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)


@pytest.mark.parametrize("mode", ["auto", "deterministic", "sm90", "sm90group"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128, 80])
@pytest.mark.parametrize("mask_kw", MASKS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()) or "none")
@pytest.mark.parametrize("case", ["ragged", "q_longer", "prefill"])
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2)])
def test_varlen_backward_matches_each_sequence(h, hk, case, mask_kw, d, dtype, mode, monkeypatch):
    """mode: the automatic kernels (sm80's for varlen), the deterministic dQ, or the Hopper dK/dV
    kernel forced (backend="sm90": H100/H200, head_dim 64, 128 and 256); sm90group: that kernel's
    GQA group loop (cuflash._backward.group_loop) on these small grids too."""
    import cupy

    from cuflash import _backward, device

    deterministic, backend = mode == "deterministic", ("sm90" if mode.startswith("sm90") else None)
    if backend and (tuple(device.query(0).cc) != (9, 0) or d not in (64, 128, 256)):
        pytest.skip("the Hopper backward: compute capability 9.0, head_dim 64, 128 or 256")
    if mode == "sm90group":
        if h == hk:
            pytest.skip("MHA: no group to loop over")
        monkeypatch.setattr(_backward, "GROUP_LOOP_MIN_WAVES", 0)
        varlen._bwd_plans.clear()
    lens_q, lens_k = RAGGED[case]
    rng = np.random.default_rng(hash((h, hk, case, str(mask_kw), d, dtype, mode, "bwd")) % 2**32)
    dt = dtype_of(dtype)
    q, k, v = _packed(rng, lens_q, h, d, dt), _packed(rng, lens_k, hk, d, dt), _packed(rng, lens_k, hk, d, dt)
    dout = _packed(rng, lens_q, h, d, dt)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    mask = MaskOptions.of(**mask_kw)
    out, lse = varlen._forward_cupy(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), mask, None)
    _poison_pool(q.shape, k.shape)
    dq, dk, dv = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                                  deterministic=deterministic, backend=backend, **mask_kw)
    for g, x in zip((dq, dk, dv), (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert not bool(cupy.isnan(g.astype(cupy.float32)).any()), "NaN (unwritten?) in a gradient"
    scale = 1 / math.sqrt(d)
    oq, ok = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(int(oq[b]), int(oq[b + 1])), slice(int(ok[b]), int(ok[b + 1]))
        if nq == 0 or nk == 0:  # no pair: zero gradients
            for g, r in ((dq, rq), (dk, rk), (dv, rk)):
                assert not bool(g[r].astype(cupy.float32).any()), b
            continue
        grads = (dq[rq][None], dk[rk][None], dv[rk][None])
        res = fa_rule_grads(grads, q[rq][None], k[rk][None], v[rk][None], dout[rq][None], mask, scale)
        for name, (err, pt, allowed) in res.items():
            assert err <= allowed, (f"sequence {b} ({nq} x {nk}) {name}: max err {err:.3e} > allowed {allowed:.3e} "
                                    f"(same-dtype {pt:.3e})")
    if deterministic:  # bitwise reproducible
        again = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                                 deterministic=True, **mask_kw)
        for g, g2 in zip((dq, dk, dv), again):
            assert bool((g.view(cupy.uint16) == g2.view(cupy.uint16)).all())


@pytest.mark.parametrize("mask_kw", MASKS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()) or "none")
@pytest.mark.parametrize("case", ["ragged", "q_longer", "prefill"])
@pytest.mark.parametrize("mode", ["sm90", "sm90group"])
def test_varlen_backward_split_head_dim(case, mask_kw, mode, monkeypatch):
    """The Hopper backward's split-head-dim tile (head_dim 256) on packed batches, GQA 8/2, bf16 (and
    its GQA group loop)."""
    test_varlen_backward_matches_each_sequence(8, 2, case, mask_kw, 256, "bfloat16", mode, monkeypatch)


def torch_packed(torch, seed: int = 0):
    """(q, k, v, cu_seqlens): two packed bf16 sequences of 15 and 25 tokens, 4 heads, d64, q, k, v
    requiring grad (the torch tests' small batch)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(40, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    return q, k, v, torch.tensor([0, 15, 40], device="cuda", dtype=torch.int32)


def test_torch_autograd_matches_dense_per_sequence():
    torch = pytest.importorskip("torch")
    import cuflash

    q, k, v, cu = torch_packed(torch)
    out = cuflash.attention_varlen(q, k, v, cu, cu, 25, 25, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.requires_grad
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in ((0, 15), (15, 40)):
        qs, ks, vs = (x.detach()[None, a:b].clone().requires_grad_() for x in (q, k, v))
        ref = cuflash.attention(qs, ks, vs, causal=True)
        ref_grads = torch.autograd.grad(ref, (qs, ks, vs), dout[None, a:b])
        assert float((out[a:b].float() - ref[0].float()).abs().max()) <= 2e-2
        for got, want in zip(grads, ref_grads):
            assert float((got[a:b].float() - want[0].float()).abs().max()) <= 5e-2


def _draw(seed: int) -> dict:
    """A random varlen case, a pure function of the seed (printed on failure)."""
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 7))
    short = lambda: int(rng.choice([0, 1, 2, 17, 63, 64, 65, 128, 129, 300, 777]))
    lens_q = [short() for _ in range(batch)]
    lens_k = [short() if rng.random() < 0.5 else n for n in lens_q]
    hkv = int(rng.choice([1, 2, 3]))
    return dict(seed=seed, lens_q=lens_q, lens_k=lens_k, hkv=hkv, h=hkv * int(rng.choice([1, 2, 4])),
                d=int(rng.choice([8, 32, 40, 64, 96, 128, 136, 192, 256])), dtype=str(rng.choice(["bfloat16", "float16"])),
                causal=bool(rng.random() < 0.5), alignment=str(rng.choice(["bottom_right", "top_left"])),
                window=(int(rng.choice([-1, 0, 17, 200])), int(rng.choice([-1, 0, 5]))) if rng.random() < 0.3 else (-1, -1),
                softcap=float(rng.choice([5.0, 30.0])) if rng.random() < 0.15 else 0.0,
                deterministic=bool(rng.random() < 0.3))


@pytest.mark.parametrize("seed", range(40))
def test_varlen_fuzz(seed):
    import cupy

    c = _draw(seed)
    try:
        rng = np.random.default_rng(seed)
        dt = dtype_of(c["dtype"])
        lens_q, lens_k, h, hkv, d = c["lens_q"], c["lens_k"], c["h"], c["hkv"], c["d"]
        q, k, v = _packed(rng, lens_q, h, d, dt), _packed(rng, lens_k, hkv, d, dt), _packed(rng, lens_k, hkv, d, dt)
        dout = _packed(rng, lens_q, h, d, dt)
        kw = dict(causal=c["causal"], alignment=c["alignment"], window_size=c["window"], softcap=c["softcap"])
        mask = MaskOptions.of(**kw)
        cu_q, cu_k = _cu(lens_q), _cu(lens_k)
        mq, mk = max(lens_q), max(lens_k)
        out, lse = varlen.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, **kw)
        grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk,
                                                 deterministic=c["deterministic"], **kw)
        scale = 1 / math.sqrt(d)
        oq, ok = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
        for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
            rq, rk = slice(int(oq[b]), int(oq[b + 1])), slice(int(ok[b]), int(ok[b + 1]))
            if nq == 0 or nk == 0:
                continue
            seq = (q[rq][None], k[rk][None], v[rk][None])
            err, pt, allowed = fa_rule(out[rq][None], *seq, mask, scale)
            assert err <= allowed, f"sequence {b} out: {err:.3e} > {allowed:.3e}"
            res = fa_rule_grads((grads[0][rq][None], grads[1][rk][None], grads[2][rk][None]), *seq, dout[rq][None],
                                mask, scale)
            for name, (err, pt, allowed) in res.items():
                assert err <= allowed, f"sequence {b} {name}: {err:.3e} > {allowed:.3e} (same-dtype {pt:.3e})"
        for g in grads:
            assert not bool(cupy.isnan(g.astype(cupy.float32)).any())
    except Exception as e:
        raise AssertionError(f"varlen fuzz case {c}: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2)])
def test_varlen_dropout_forward_and_backward(h, hk, causal, dtype):
    """Dropout's mask is the dense one of each sequence's batch index (the Philox counter is the
    position in the sequence, the (batch, head) pair), so the reference takes
    dropout_keep_mask(seed, batch, heads, n_q, n_k)[b] for sequence b."""
    import cupy

    from cuflash.philox import dropout_keep_mask, dropout_scale

    lens_q, lens_k = [17, 0, 113, 64, 200], [40, 5, 113, 1, 150]
    rng = np.random.default_rng(hash((h, hk, causal, dtype, "drop")) % 2**32)
    dt, d, p, seed = dtype_of(dtype), 64, 0.25, 1234567
    q, k, v = _packed(rng, lens_q, h, d, dt), _packed(rng, lens_k, hk, d, dt), _packed(rng, lens_k, hk, d, dt)
    dout = _packed(rng, lens_q, h, d, dt)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    mq, mk = max(lens_q), max(lens_k)
    out, lse = varlen.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_lse=True, dropout_p=p,
                                       seed=seed)
    grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal=causal,
                                             dropout_p=p, seed=seed)
    scale = 1 / math.sqrt(d)
    mask = MaskOptions.of(causal=causal)
    oq, ok = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0 or nk == 0:
            continue
        rq, rk = slice(int(oq[b]), int(oq[b + 1])), slice(int(ok[b]), int(ok[b + 1]))
        keep = dropout_keep_mask(seed, len(lens_q), h, nq, nk, p)[b:b + 1]
        z = cupy.asarray(keep.astype(np.float64) * dropout_scale(p))
        seq = (q[rq][None], k[rk][None], v[rk][None])
        err, pt, allowed = fa_rule(out[rq][None], *seq, mask, scale, keep_scale=z)
        assert err <= allowed, f"sequence {b} out: {err:.3e} > {allowed:.3e}"
        res = fa_rule_grads((grads[0][rq][None], grads[1][rk][None], grads[2][rk][None]), *seq, dout[rq][None], mask,
                            scale, keep_scale=z)
        if nk == 1:  # dq and dk are rounding noise here, bounded instead of compared (_one_key_noise_bounds)
            for name, got, bound in zip(("dq", "dk"), (grads[0][rq], grads[1][rk]),
                                        _one_key_noise_bounds(q[rq], out[rq], dout[rq], k[rk], scale, hk)):
                err = float(cupy.abs(got.astype(cupy.float64)).max())
                assert err <= bound, f"sequence {b} (one key) {name}: {err:.3e} > noise bound {bound:.3e}"
            res = {"dv": res["dv"]}
        for name, (err, pt, allowed) in res.items():
            assert err <= allowed, f"sequence {b} {name}: {err:.3e} > {allowed:.3e} (same-dtype {pt:.3e})"


def _one_key_noise_bounds(q, out, dout, k, scale, heads_kv):
    """Bounds on |dq| and |dk| of a sequence with a single key, where both are zero in exact
    arithmetic (a softmax over one key has no derivative): dS = P (dP o Z - D) with D = rowsum(dO o O),
    and D is computed from O as stored, in its dtype, as FlashAttention does; the difference from the
    exact D is at most sum |dO o O| x the dtype's relative rounding. The 2x rule is no measure here:
    each row's dS is one rounding residue, the kernel's and the same-dtype reference's independent
    draws of it (a failure of 1.2e-2 against a reference of 2.9e-3 seen 2026-12-03). x2 for the fp32
    sums and the stores' own rounding; plus the output dtype's spacing near 0.3 as the rule's floor."""
    import cupy

    eps = 2.0 ** -8 if q.dtype == dtype_of("bfloat16") else 2.0 ** -11
    f = lambda x: cupy.abs(x.astype(cupy.float64))
    ds = (f(dout) * f(out)).sum(axis=-1) * eps  # (nq, h): each row's bound on |dS|
    floor = 2 * (0.3 * eps)
    dq = 2 * scale * float(ds.max()) * float(f(k).max()) + floor
    dk = 2 * scale * float((ds[..., None] * f(q)).sum(axis=0).max()) * (q.shape[1] // heads_kv) + floor
    return dq, dk


def test_varlen_backward_past_65535_sequences_grid_axis():
    """70,001 sequences (issue 14: grids beyond 65,535 blocks in any dimension): the row-wise
    kernels (bwd_prep_varlen, bwd_dq_convert_varlen) put the sequences on the grid's z and stride
    over those past its 65,535. Equal lengths, so the packed batch is a dense one: gradients by the
    2x rule against the float64 reference of that dense batch, outputs poisoned (a sequence the
    kernels missed would keep NaN or a stale dQ)."""
    import cupy

    nseq, nq, nk, h, d = 70001, 3, 5, 2, 32
    rng = np.random.default_rng(70001)
    dt = dtype_of("bfloat16")
    q, k, v = _packed(rng, [nq] * nseq, h, d, dt), _packed(rng, [nk] * nseq, h, d, dt), _packed(rng, [nk] * nseq, h, d, dt)
    dout = _packed(rng, [nq] * nseq, h, d, dt)
    cu_q, cu_k = _cu([nq] * nseq), _cu([nk] * nseq)
    mask = MaskOptions.of(causal=True)
    out, lse = varlen._forward_cupy(q, k, v, cu_q, cu_k, nq, nk, mask, None)
    for deterministic in (False, True):
        _poison_pool(q.shape, k.shape)
        grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, nq, nk, causal=True,
                                                 deterministic=deterministic)
        dense = [g.reshape(nseq, -1, h, d) for g in grads]
        for g in dense:
            assert bool(cupy.isfinite(g.astype(cupy.float32)).all())
        res = fa_rule_grads(dense, q.reshape(nseq, nq, h, d), k.reshape(nseq, nk, h, d), v.reshape(nseq, nk, h, d),
                            dout.reshape(nseq, nq, h, d), mask, 1 / math.sqrt(d))
        for name, (err, pt, allowed) in res.items():
            assert err <= allowed, (deterministic, name, err, allowed, pt)


def test_torch_compile_runs_varlen():
    """attention_varlen inside torch.compile (issue 12: every path): its autograd.Function runs CuPy,
    which dynamo does not trace, so the call is a graph break; the result and the gradients must be
    the eager call's, bit for bit (deterministic backward)."""
    torch = pytest.importorskip("torch")
    import cuflash

    torch._dynamo.reset()
    q, k, v, cu = torch_packed(torch, 3)

    def f(q, k, v):
        return cuflash.attention_varlen(q, k, v, cu, cu, 25, 25, causal=True, deterministic=True) * 2.0

    dout = torch.randn_like(q)
    eager = f(q, k, v)
    eager_grads = torch.autograd.grad(eager, (q, k, v), dout)
    compiled = torch.compile(f)(q, k, v)
    compiled_grads = torch.autograd.grad(compiled, (q, k, v), dout)
    assert torch.equal(compiled, eager)
    for a, b in zip(compiled_grads, eager_grads):
        assert torch.equal(a, b)
