"""A value head dim of its own (issue 12; MLA's 192 / 128) on the GPU: forward and backward against
float64 by FlashAttention's 2x rule, outputs poisoned first; (d_qk, d_v) pairs on both sides of each
other, both dtypes, causal and windows, GQA, dropout, deterministic dQ, varlen, torch autograd. The
kernels run the instance of the larger head dim with each side's columns masked (Features.partial_d);
on a cc 9.0 GPU the automatic choice falls back from the Hopper families to the mma.sync ones."""
from __future__ import annotations

import math

import numpy as np
import pytest

import cuflash
from cuflash import _backward, _forward
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule, fa_rule_grads

pytestmark = pytest.mark.gpu

PAIRS = [(192, 128), (128, 64), (64, 128), (96, 64), (40, 24), (256, 128)]


def _qkv(seed, b, nq, nk, h, hkv, d, dv, dtype):
    import cupy

    rng = np.random.default_rng(seed)
    mk = lambda *s: cupy.asarray(rng.standard_normal(s).astype(np.float32)).astype(dtype_of(dtype))  # noqa: E731
    return mk(b, nq, h, d), mk(b, nk, hkv, d), mk(b, nk, hkv, dv), mk(b, nq, h, dv)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dv", PAIRS)
def test_forward_and_backward_meet_the_rule(d, dv, causal, dtype):
    import cupy

    q, k, v, dout = _qkv(d * 1000 + dv + causal, 2, 173, 301, 4, 2, d, dv, dtype)
    mask = MaskOptions.of(causal=causal)
    scale = 1 / math.sqrt(d)
    out = cupy.full((2, 173, 4, dv), np.nan, dtype=q.dtype)
    lse = cupy.full((2, 4, 173), np.nan, dtype=cupy.float32)
    out, lse = _forward.forward(q, k, v, mask=mask, out=out, lse=lse)
    assert out.shape == (2, 173, 4, dv)
    err, pt, allowed = fa_rule(out, q, k, v, mask, scale)
    assert err <= allowed, f"out: {err:.3e} > {allowed:.3e}"
    for det in (False, True):
        grads = _backward.backward(dout, q, k, v, out, lse, mask=mask, deterministic=det)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        for name, (err, pt, allowed) in fa_rule_grads(grads, q, k, v, dout, mask, scale).items():
            assert err <= allowed, f"{name} (deterministic {det}): {err:.3e} > {allowed:.3e}"


@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128)])
def test_windows_softcap_and_dropout(d, dv):
    import cupy

    from cuflash.philox import dropout_keep_mask, dropout_scale

    q, k, v, dout = _qkv(7, 1, 150, 200, 2, 1, d, dv, "bfloat16")
    mask = MaskOptions.of(causal=True, window_size=(37, 0), softcap=20.0)
    scale = 1 / math.sqrt(d)
    out, lse = cuflash.attention(q, k, v, causal=True, window_size=(37, 0), softcap=20.0, return_lse=True)
    err, pt, allowed = fa_rule(out, q, k, v, mask, scale)
    assert err <= allowed
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, window_size=(37, 0), softcap=20.0)
    for name, (err, pt, allowed) in fa_rule_grads(grads, q, k, v, dout, mask, scale).items():
        assert err <= allowed, name
    p, seed = 0.2, 11
    z = cupy.asarray(dropout_keep_mask(seed, 1, 2, 150, 200, p).astype(np.float64) * dropout_scale(p))
    out, lse = cuflash.attention(q, k, v, causal=True, dropout_p=p, seed=seed, return_lse=True)
    err, pt, allowed = fa_rule(out, q, k, v, MaskOptions.of(causal=True), scale, keep_scale=z)
    assert err <= allowed
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, dropout_p=p, seed=seed)
    for name, (err, pt, allowed) in fa_rule_grads(grads, q, k, v, dout, MaskOptions.of(causal=True), scale,
                                                  keep_scale=z).items():
        assert err <= allowed, name


def test_varlen_forward_and_backward():
    """Packed sequences (one of length 0): each sequence's rows against its own dense reference."""
    import cupy

    d, dv = 192, 128
    lens_q, lens_k = [33, 0, 130, 7], [50, 9, 130, 80]
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lens_q)]), dtype=cupy.int32)
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lens_k)]), dtype=cupy.int32)
    q, k, v, dout = (x[0] for x in _qkv(3, 1, sum(lens_q), sum(lens_k), 4, 2, d, dv, "bfloat16"))
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True)
    assert out.shape == (sum(lens_q), 4, dv)
    dq, dk, dv_ = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                                    causal=True)
    assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)
    mask, scale = MaskOptions.of(causal=True), 1 / math.sqrt(d)
    for b in range(4):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0:
            continue
        one = lambda x, s: x[s][None]  # noqa: E731
        err, pt, allowed = fa_rule(one(out, qs), one(q, qs), one(k, ks), one(v, ks), mask, scale)
        assert err <= allowed, b
        g = (one(dq, qs), one(dk, ks), one(dv_, ks))
        for name, (err, pt, allowed) in fa_rule_grads(g, one(q, qs), one(k, ks), one(v, ks), one(dout, qs), mask,
                                                      scale).items():
            assert err <= allowed, (b, name)


def test_torch_autograd():
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(2, 90, 4, 192, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    k = torch.randn(2, 120, 2, 192, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    v = torch.randn(2, 120, 2, 128, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    out = cuflash.attention(q, k, v, causal=True)  # bottom-right: query i sees keys up to i + 30
    assert out.shape == (2, 90, 4, 128)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().repeat_interleave(2, 2).transpose(1, 2),
        v.float().repeat_interleave(2, 2).transpose(1, 2), is_causal=False,
        attn_mask=torch.ones(90, 120, device="cuda", dtype=torch.bool).tril(120 - 90)).transpose(1, 2)
    rgrads = torch.autograd.grad(ref, (q, k, v), dout.float())
    assert (out.float() - ref).abs().max() < 0.05
    for a, b in zip(grads, rgrads):
        assert a.shape == b.shape and (a.float() - b).abs().max() < 0.1


def test_forcing_the_hopper_backward_says_why():
    """The Hopper forward takes a value head dim of its own (rank-4 maps); its backward does not."""
    from cuflash import _backward

    q, k, v, dout = _qkv(1, 1, 64, 64, 2, 2, 128, 64, "bfloat16")
    out, lse = cuflash.attention(q, k, v, backend="sm90", return_lse=True)
    with pytest.raises(ValueError, match="value head dim other than q's"):
        _backward.backward(dout, q, k, v, out, lse, backend="sm90")


SM90_PAIRS = [(192, 128), (128, 64), (64, 128), (256, 128), (160, 160), (40, 40), (104, 72), (200, 248)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d,dv", SM90_PAIRS)
def test_sm90_forward_of_column_masking_instances(d, dv, dtype):
    """The Hopper forward forced (backend="sm90") on calls that run a column-masking instance: v's
    own head dim, and head dims between the instances (40 -> 64, 104 -> 128, 160 -> 192, 200 /
    248 -> 256): the rank-4 TMA maps, their zero-filled tail chunk and the chunks never loaded
    (64 / 128: q and k's second chunk entirely past their head dim). Causal or not, a window with
    softcap, GQA, ragged lengths; outputs poisoned; and equal (2x rule) to the automatic choice."""
    import cupy

    q, k, v, _ = _qkv(d * 1000 + dv + 90, 2, 173, 301, 4, 2, d, dv, dtype)
    scale = 1 / math.sqrt(d)
    for kw in ({}, {"causal": True}, {"causal": True, "window_size": (37, 0), "softcap": 20.0}):
        mask = MaskOptions.of(**kw)
        out = cupy.full((2, 173, 4, dv), np.nan, dtype=q.dtype)
        lse = cupy.full((2, 4, 173), np.nan, dtype=cupy.float32)
        out, lse = _forward.forward(q, k, v, mask=mask, out=out, lse=lse, backend="sm90")
        err, pt, allowed = fa_rule(out, q, k, v, mask, scale)
        assert err <= allowed, f"{kw}: {err:.3e} > {allowed:.3e} (same-dtype {pt:.3e})"
        assert bool(cupy.isfinite(lse).all())
    # the automatic choice (this same kernel on a cc 9.0 GPU)
    auto, _ = _forward.forward(q, k, v, mask=MaskOptions.of(causal=True))
    err, pt, allowed = fa_rule(auto, q, k, v, MaskOptions.of(causal=True), scale)
    assert err <= allowed
