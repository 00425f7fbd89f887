"""GQA / MQA (k and v with fewer heads than q, dividing them; issue 12) on the GPU: forward (sm80 v2,
v1, sm90) and backward (sm80, deterministic or not; the opt-in sm90 dK/dV kernel) against the float64
reference by FlashAttention's 2x rule (cuflash.testing repeats each k/v head for its group and sums
dK, dV over it), outputs poisoned; and bitwise agreement with MHA on k, v repeated per query head,
which the kernels compute with the same arithmetic (only the k/v head index differs)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash.testing import dtype_of, fa_rule, fa_rule_grads, random_qkv, repeat_kv
from tests.gpu.test_backward_gpu import _check as _check_grads
from tests.gpu.test_forward_gpu import backend  # noqa: F401  (the sm80 / sm90 fixture)
from tests.gpu.test_forward_gpu import check_out_and_lse

pytestmark = pytest.mark.gpu

H = 8
HEADS_KV = [8, 4, 2, 1]  # groups 1, 2, 4, 8 (the last is MQA)
SEQLENS = [(1, 1), (17, 17), (113, 203), (239, 1), (1, 239), (799, 3), (257, 190), (1023, 1024)]


def _same_bits(a, b) -> bool:
    import cupy

    return a.shape == b.shape and bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


def _poisoned_fwd(fwd, q, k, v, causal, **kw):
    import cupy

    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
    return fwd(q, k, v, causal=causal, out=out, lse=lse, **kw)


def _poison_pool(*arrays_like, copies=3):
    """Fill blocks of CuPy's pool of the sizes the backward plan allocates with NaN (0xFFFF is a NaN
    in fp16 and bf16) and free them: the plan's fresh gradients then start as NaN, so an element
    no kernel writes is caught."""
    import cupy

    keep = []
    for shape in arrays_like:
        for _ in range(copies):
            a = cupy.empty(shape, dtype=cupy.uint16)
            a.fill(0xFFFF)
            keep.append(a)
    cupy.cuda.get_current_stream().synchronize()
    del keep


def _inputs(seed, b, nq, nk, hkv, d, dtype):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, b, nq, nk, H, d, dtype_of(dtype), heads_kv=hkv)
    dout, _, _ = random_qkv(rng, b, nq, 1, H, d, dtype_of(dtype))
    return q, k, v, dout


def _check_forward(out, lse, q, k, v, causal):
    import cupy

    assert out.shape == q.shape and lse.shape == (q.shape[0], H, q.shape[1])
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any()), "unwritten or NaN output"
    assert not bool(cupy.isnan(lse).any()), "unwritten lse"
    scale = 1 / math.sqrt(q.shape[-1])
    check_out_and_lse(out, lse, q, k, v, causal, scale)


@pytest.mark.parametrize("hkv", HEADS_KV)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SEQLENS)
def test_gqa_forward(nq, nk, causal, d, dtype, hkv, backend):  # noqa: F811
    import cuflash
    from cuflash import _forward

    q, k, v, _ = _inputs(hash((nq, nk, causal, d, dtype, hkv, "gqa-fwd")) % 2**32, 2, nq, nk, hkv, d, dtype)
    out, lse = _poisoned_fwd(_forward.forward, q, k, v, causal, backend=backend)
    _check_forward(out, lse, q, k, v, causal)
    # the public entry point: same bits; MHA on repeated k, v: same bits (same arithmetic per head)
    assert _same_bits(cuflash.attention(q, k, v, causal=causal, backend=backend), out)
    mha = cuflash.attention(q, repeat_kv(k, H), repeat_kv(v, H), causal=causal, backend=backend)
    assert _same_bits(mha, out)


@pytest.mark.parametrize("hkv", HEADS_KV)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(17, 17), (113, 203), (239, 1), (799, 3), (257, 190)])
def test_gqa_forward_v1(nq, nk, causal, dtype, hkv):
    import cuflash
    from cuflash._forward_v1 import forward_v1

    for d in (64, 128):
        q, k, v, _ = _inputs(hash((nq, nk, causal, d, dtype, hkv, "gqa-v1")) % 2**32, 2, nq, nk, hkv, d, dtype)
        out, lse = _poisoned_fwd(forward_v1, q, k, v, causal)
        _check_forward(out, lse, q, k, v, causal)
        assert _same_bits(cuflash.attention(q, k, v, causal=causal, algorithm="v1"), out)
        assert _same_bits(forward_v1(q, repeat_kv(k, H), repeat_kv(v, H), causal=causal)[0], out)


def _sequential_group_sum(g, hkv):
    """What bwd_dkdv_reduce computes from per-query-head gradients: an fp32 sum over each group in
    head order, starting from 0, rounded once to the gradient's dtype."""
    import cupy

    b, n, h, d = g.shape
    group = h // hkv
    if group == 1:  # MHA: no reduce launch, the kernel's own bits (a sum from +0 would turn -0 into +0)
        return g
    g = g.reshape(b, n, hkv, group, d)
    acc = cupy.zeros((b, n, hkv, d), dtype=cupy.float32)
    for i in range(group):
        acc += g[:, :, :, i].astype(cupy.float32)
    return acc.astype(g.dtype)


def _run_bwd(q, k, v, dout, causal, **kw):
    from cuflash import _backward, _forward

    out, lse = _forward.forward(q, k, v, causal=causal)
    b, nq, h, d = q.shape
    _poison_pool(q.shape, k.shape, (b, k.shape[1], h, d))
    return _backward.backward(dout, q, k, v, out, lse, causal=causal, **kw)


@pytest.mark.parametrize("hkv", HEADS_KV)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SEQLENS)
def test_gqa_backward_sm80(nq, nk, causal, d, dtype, deterministic, hkv):
    q, k, v, dout = _inputs(hash((nq, nk, causal, d, dtype, hkv, deterministic, "gqa-bwd")) % 2**32, 2, nq, nk,
                            hkv, d, dtype)
    grads = _run_bwd(q, k, v, dout, causal, deterministic=deterministic)
    _check_grads(grads, q, k, v, dout, causal)
    if deterministic:  # MHA on repeated k, v: dq the same bits, dk/dv its per-head gradients summed
        mha = _run_bwd(q, repeat_kv(k, H), repeat_kv(v, H), dout, causal, deterministic=True)
        assert _same_bits(grads[0], mha[0])
        assert _same_bits(grads[1], _sequential_group_sum(mha[1], hkv))
        assert _same_bits(grads[2], _sequential_group_sum(mha[2], hkv))


def _sm90_unavailable() -> str | None:
    from cuflash import device

    props = device.query(0)
    return None if tuple(props.cc) == (9, 0) else f"the sm90 backward needs cc 9.0, this GPU is {props.cc_str}"


@pytest.mark.parametrize("hkv", HEADS_KV)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SEQLENS)
def test_gqa_backward_sm90(nq, nk, causal, d, dtype, hkv, monkeypatch):
    """The Hopper dK/dV kernel (cuflash._backward.backward(..., backend="sm90")). By default GQA runs
    its group loop (dK, dV summed over the group in registers, rounded once): the 2x rule. With the
    loop off (as for dropout or ALiBi) dK, dV per query head are deterministic (dQ is by atomics),
    so dk/dv match MHA's summed by bwd_dkdv_reduce bitwise."""
    from cuflash import _backward

    why = _sm90_unavailable()
    if why:
        pytest.skip(why)
    q, k, v, dout = _inputs(hash((nq, nk, causal, d, dtype, hkv, "gqa-bwd90")) % 2**32, 2, nq, nk, hkv, d, dtype)
    _backward._plans.clear()
    monkeypatch.setattr(_backward, "GROUP_LOOP_MIN_WAVES", 0)  # these small grids take it too
    grads = _run_bwd(q, k, v, dout, causal, backend="sm90")
    _check_grads(grads, q, k, v, dout, causal, " (sm90, group loop)" if hkv < H else " (sm90)")
    _backward._plans.clear()
    monkeypatch.setattr(_backward, "group_loop", lambda p, cfg, dq_cfg: False)
    expanded = _run_bwd(q, k, v, dout, causal, backend="sm90")
    _backward._plans.clear()
    _check_grads(expanded, q, k, v, dout, causal, " (sm90, expanded)")
    mha = _run_bwd(q, repeat_kv(k, H), repeat_kv(v, H), dout, causal, backend="sm90")
    assert _same_bits(expanded[1], _sequential_group_sum(mha[1], hkv))
    assert _same_bits(expanded[2], _sequential_group_sum(mha[2], hkv))
    if hkv == H:  # MHA: the same kernel either way
        assert _same_bits(grads[1], expanded[1]) and _same_bits(grads[2], expanded[2])


def test_gqa_public_backward_and_dropout():
    """attention_backward (the public entry point) with GQA shapes, and GQA with dropout (the mask is
    per query head): dk, dv have k's heads and the 2x rule holds against the same keep mask."""
    import cupy

    import cuflash
    from cuflash.philox import dropout_keep_mask, dropout_scale

    q, k, v, dout = _inputs(11, 2, 200, 333, 2, 64, "bfloat16")
    scale = 1 / math.sqrt(64)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    _check_grads((dq, dk, dv), q, k, v, dout, True, " (public)")
    p, seed = 0.2, 1234
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, dropout_p=p, seed=seed)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, dropout_p=p, seed=seed)
    # the keep mask is per query head (b, H, nq, nk), as for MHA
    z = cupy.asarray(dropout_keep_mask(seed, 2, H, 200, 333, p).astype(np.float64) * dropout_scale(p))
    err, pt_err, allowed = fa_rule(out, q, k, v, True, scale, keep_scale=z)
    assert err <= allowed, f"out: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt_err:.3e})"
    res = fa_rule_grads(grads, q, k, v, dout, True, scale, keep_scale=z)
    for name, (err, pt_err, allowed) in res.items():
        assert err <= allowed, f"{name} (dropout): max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt_err:.3e})"


def test_gqa_torch_autograd_matches_the_cupy_path():
    torch = pytest.importorskip("torch")
    import cupy

    import cuflash

    q, k, v, dout = _inputs(13, 2, 130, 130, 2, 128, "float16")
    tq, tk, tv, tdo = (torch.from_dlpack(x).requires_grad_(x is not dout) for x in (q, k, v, dout))
    tout = cuflash.attention(tq, tk, tv, causal=True, deterministic=True)
    tout.backward(tdo)
    assert tk.grad.shape == tk.shape == (2, 130, 2, 128) and tv.grad.shape == tv.shape
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    assert _same_bits(cupy.from_dlpack(tout.detach()), out)
    for t, g in zip((tq, tk, tv), grads):
        assert _same_bits(cupy.from_dlpack(t.grad), g)
