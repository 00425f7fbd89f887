"""Attention sinks on the GPU (issue 13; gpt-oss): cuflash.attention(..., sinks=) against the
definition (a sink column in every row's softmax) computed in float64 by torch, with
FlashAttention's 2x rule against the same computation in the inputs' dtype: the output, lse, and
the gradients of q, k, v and the sinks through torch autograd; and the CuPy path's output and its
backward (attention_backward on the returned out and lse, cuflash.sinks.grad)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _reference(q, k, v, sinks, causal, window, dtype):
    """(out, lse) of sink attention from the definition, computed in `dtype` ((b, n, h, d) layout)."""
    q, k, v, s = (x.to(dtype) for x in (q, k, v, sinks))
    h, hk = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(h // hk, 2), v.repeat_interleave(h // hk, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    nq, nk = q.shape[1], k.shape[1]
    i = torch.arange(nq, device=q.device)[:, None] + nk - nq
    j = torch.arange(nk, device=q.device)[None, :]
    ok = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        ok &= j <= i
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    scores = scores.masked_fill(~ok, float("-inf"))
    ext = torch.cat([scores, s[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
    p = torch.softmax(ext, -1)[..., :nk]
    return torch.einsum("bhqk,bkhd->bqhd", p, v), torch.logsumexp(ext, -1)


def _allowed(got, ref, same):
    err = (got.double() - ref).abs().max().item()
    pt = (same.double() - ref).abs().max().item()
    return err, pt, 2 * pt + 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (100, -1))])
@pytest.mark.parametrize("h,hk,nq,nk", [(8, 2, 333, 517), (4, 4, 1, 1000), (4, 1, 64, 64)])
def test_torch_sinks_match_the_definition(h, hk, nq, nk, causal, window, dtype):
    import cuflash

    g = torch.Generator(device="cuda").manual_seed(hash((h, hk, nq, nk, causal, window)) % 2**31)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g).requires_grad_()
    q, k, v = mk(2, nq, h, 64), mk(2, nk, hk, 64), mk(2, nk, hk, 64)
    sinks = (torch.randn(h, device="cuda", generator=g) * 3).requires_grad_()
    out, lse = cuflash.attention(q, k, v, causal=causal, window_size=window, sinks=sinks, return_lse=True)
    dout = torch.randn(out.shape, device="cuda", dtype=dtype, generator=g)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    refs = {}
    for name, dt in (("ref", torch.float64), ("same", dtype)):
        o, l = _reference(q, k, v, sinks, causal, window, dt)
        refs[name] = (o, l, torch.autograd.grad(o, (q, k, v, sinks), dout.to(dt)))
    err, pt, allowed = _allowed(out, refs["ref"][0], refs["same"][0])
    assert err <= allowed, f"out: {err:.3e} > {allowed:.3e} (same-dtype {pt:.3e})"
    assert (lse.double() - refs["ref"][1]).abs().max().item() <= 1e-3
    for name, got, r, s in zip(("dq", "dk", "dv", "dsinks"), grads, refs["ref"][2], refs["same"][2]):
        err, pt, allowed = _allowed(got, r, s)
        if name == "dsinks":
            allowed += _rounding_floor(out, dout, refs["ref"][1], sinks)
        assert err <= allowed, f"{name}: {err:.3e} > {allowed:.3e} (same-dtype {pt:.3e})"


def _rounding_floor(out, dout, lse, sinks):
    """The first-order error of d sinks that comes from `out` being stored in its 16-bit dtype:
    d sinks[h] = -sum e^(sink_h - lse) (dout . out), each product off by at most unit roundoff x
    |dout| . |out|. The same-dtype computation forms dout . out from an unrounded out (autograd of
    the softmax), so for a gradient summed over few rows (one query, a batch of 2) its error can
    be several times smaller than this unavoidable one; the dq/dk/dv checks need no such floor."""
    u = torch.finfo(out.dtype).eps / 2
    mag = (dout.double().abs() * out.detach().double().abs()).sum(-1).transpose(1, 2)  # (b, h, nq)
    p_sink = torch.exp(sinks.detach().double()[None, :, None] - lse)
    return u * (p_sink * mag).sum((0, 2)).max().item()


def test_cupy_sinks_forward_and_backward():
    import cupy

    import cuflash
    from cuflash import sinks as sinks_mod

    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 200, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    s = torch.randn(4, device="cuda", generator=g)
    cq, ck, cv, cs = (cupy.from_dlpack(x) for x in (q, k, v, s))
    out, lse = cuflash.attention(cq, ck, cv, causal=True, sinks=cs, return_lse=True)
    ref_out, ref_lse = _reference(q, k, v, s, True, (-1, -1), torch.float64)
    same, _ = _reference(q, k, v, s, True, (-1, -1), torch.bfloat16)
    err, pt, allowed = _allowed(torch.from_dlpack(out), ref_out, same)
    assert err <= allowed, f"out: {err:.3e} > {allowed:.3e}"
    dout = cupy.from_dlpack(torch.randn(1, 200, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g))
    dq, dk, dv = cuflash.attention_backward(dout, cq, ck, cv, out, lse, causal=True)
    ds = sinks_mod.grad(dout, out, lse, cs)
    tq, tk, tv, ts = (x.detach().double().requires_grad_() for x in (q, k, v, s))
    o, _ = _reference(tq, tk, tv, ts, True, (-1, -1), torch.float64)
    want = torch.autograd.grad(o, (tq, tk, tv, ts), torch.from_dlpack(dout).double())
    for name, got, w in zip(("dq", "dk", "dv", "dsinks"), (dq, dk, dv, ds), want):
        rel = (torch.from_dlpack(got).double() - w).abs().max().item() / max(w.abs().max().item(), 1e-6)
        assert rel <= 3e-2, f"{name}: relative error {rel:.3e}"


@pytest.mark.parametrize("used", [False, True])
def test_varlen_sinks_match_dense_per_sequence(used):
    """attention_varlen(sinks=) through torch autograd (gpt-oss's padded or packed batches in the
    transformers integration): each sequence's output and q, k, v gradients, and the sinks'
    gradient summed over the sequences, against cuflash.attention(sinks=) on that sequence alone.
    used: with seqused_q / seqused_k (the rows past them: out 0, no gradient)."""
    import cuflash

    g = torch.Generator(device="cuda").manual_seed(7)
    lens, h, hk, d = [70, 33, 120], 8, 2, 64
    use = [60, 33, 100] if used else lens
    cu = torch.tensor([0, 70, 103, 223], device="cuda", dtype=torch.int32)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()  # noqa: E731
    q, k, v = mk(223, h, d), mk(223, hk, d), mk(223, hk, d)
    sinks = (torch.randn(h, device="cuda", generator=g) * 3).requires_grad_()
    extra = dict(seqused_q=torch.tensor(use, device="cuda", dtype=torch.int32),
                 seqused_k=torch.tensor(use, device="cuda", dtype=torch.int32)) if used else {}
    out = cuflash.attention_varlen(q, k, v, cu, cu, 120, 120, causal=True, sinks=sinks, **extra)
    dout = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    dsinks = torch.zeros_like(sinks)
    for b, (a, n) in enumerate(zip(cu.tolist()[:-1], use)):
        xs = [x.detach()[None, a:a + n].clone().requires_grad_() for x in (q, k, v)]
        s = sinks.detach().clone().requires_grad_()
        ref = cuflash.attention(*xs, causal=True, sinks=s)
        ref_grads = torch.autograd.grad(ref, (*xs, s), dout[None, a:a + n])
        assert float((out[a:a + n].float() - ref[0].float()).abs().max()) <= 2e-2, b
        for got, want in zip(grads[:3], ref_grads[:3]):
            assert float((got[a:a + n].float() - want[0].float()).abs().max()) <= 5e-2, b
        dsinks += ref_grads[3]
        if n < lens[b]:  # unused rows
            assert not bool(out[a + n:a + lens[b]].float().any()) and not bool(grads[0][a + n:a + lens[b]].float().any())
    assert float((grads[3] - dsinks).abs().max()) <= 1e-2 * max(1.0, float(dsinks.abs().max()))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [8, 64, 128, 256])
def test_fused_rescale_and_grad_match_the_float64_definition(dtype, d):
    """cuflash.sinks' fused kernels (apply: one pass over out; grad: one over dout and out') against
    the float64 definition, on a strided out (a slice of a wider array), with a row that sees no key
    (lse -inf: out' 0, lse' the sink) and a NaN row; CuPy arrays, then torch tensors on a side stream."""
    import cupy
    import numpy as np

    from cuflash import sinks as sinks_mod
    from cuflash.testing import dtype_of

    dt = dtype_of(dtype)
    rng = np.random.default_rng(d)
    b, n, h = 2, 37, 3
    wide = cupy.asarray(rng.standard_normal((b, n, h, d + 16)).astype(np.float32)).astype(dt)
    out = wide[..., 8:8 + d]  # rows contiguous, strides of d + 16 elements
    lse = cupy.asarray(rng.standard_normal((b, h, n)).astype(np.float32) * 3)
    lse[0, 1, 5] = -np.inf
    lse[1, 2, 7] = np.nan
    sinks = cupy.asarray(rng.standard_normal(h).astype(np.float32))
    assert sinks_mod._fusable(out, lse)
    poison = cupy.empty((b, n, h, d), dtype=dt)  # NaN bits where CuPy's pool will put out' next
    poison.view(cupy.uint16).fill(0x7FC0 if dtype == "bfloat16" else 0x7E00)
    del poison
    out2, lse2 = sinks_mod.apply(out, lse, sinks)
    o64, l64, s64 = (cupy.asnumpy(x.astype(cupy.float32)).astype(np.float64) for x in (out, lse, sinks))
    want_lse = np.logaddexp(l64, s64[None, :, None])
    with np.errstate(invalid="ignore"):
        w = np.where(np.isneginf(l64), 0.0, np.exp(l64 - want_lse))
    want_out = o64 * w.transpose(0, 2, 1)[..., None]
    got_out = cupy.asnumpy(out2.astype(cupy.float32)).astype(np.float64)
    ulp = 2.0 ** (-7 if dtype == "bfloat16" else -10)  # one unit in the last place: a rounding on either side
    ok = ~np.isnan(want_out)
    tiny = 2.0 ** -24 if dtype == "float16" else 0.0  # fp16's subnormal spacing (below 6.1e-5)
    assert np.all(np.abs(got_out - want_out)[ok] <= ulp * np.abs(want_out)[ok] + tiny + 1e-30)
    assert np.isnan(got_out[1, 7, 2]).all() and np.isnan(cupy.asnumpy(lse2)[1, 2, 7])
    assert (got_out[0, 5, 1] == 0).all() and cupy.asnumpy(lse2)[0, 1, 5] == np.float32(s64[1])
    finite = ~np.isnan(want_lse)
    np.testing.assert_allclose(cupy.asnumpy(lse2)[finite], want_lse[finite], rtol=1e-6, atol=1e-6)

    lse2[1, 2, 7] = 0.0  # the gradient over finite rows
    out2.view(cupy.uint16)[1, 7, 2] = 0
    dout = cupy.asarray(rng.standard_normal((b, n, h, d)).astype(np.float32)).astype(dt)
    g = sinks_mod.grad(dout, out2, lse2, sinks)
    d64, oo, ll = (cupy.asnumpy(x.astype(cupy.float32)).astype(np.float64) for x in (dout, out2, lse2))
    dot = (d64 * oo).sum(-1).transpose(0, 2, 1)
    want_g = -(np.exp(s64[None, :, None] - ll) * dot).sum((0, 2))
    np.testing.assert_allclose(cupy.asnumpy(g), want_g, rtol=1e-5, atol=1e-5)

    c_out2, c_lse2 = sinks_mod.apply(out, lse, sinks)  # torch tensors, on a side stream: the same bits
    cupy.cuda.Device().synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t_out = torch.from_dlpack(out.view(cupy.int16)).view(getattr(torch, dtype))
        t_out2, t_lse2 = sinks_mod.apply(t_out, torch.from_dlpack(lse), torch.from_dlpack(sinks))
    side.synchronize()
    assert t_out2.dtype == getattr(torch, dtype) and t_out2.is_contiguous()
    assert torch.equal(t_out2.view(torch.int16), torch.from_dlpack(c_out2.view(cupy.int16)))
    torch.testing.assert_close(t_lse2, torch.from_dlpack(c_lse2), rtol=0, atol=0, equal_nan=True)


def test_fused_grad_takes_any_dout_layout():
    """A dout the fused kernel cannot read (torch's expanded ones: stride 0) takes the elementwise
    steps, with the same result."""
    from cuflash import sinks as sinks_mod

    g = torch.Generator(device="cuda").manual_seed(11)
    out2 = torch.randn(1, 50, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    lse2 = torch.randn(1, 2, 50, device="cuda", generator=g)
    s = torch.randn(2, device="cuda", generator=g)
    ones = torch.ones((), device="cuda", dtype=torch.bfloat16).expand(1, 50, 2, 64)
    assert not sinks_mod._fusable(ones, lse2)
    got = sinks_mod.grad(ones, out2, lse2, s)
    want = sinks_mod.grad(ones.contiguous(), out2, lse2, s)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
