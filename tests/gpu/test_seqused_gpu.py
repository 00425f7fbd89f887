"""seqused_q / seqused_k on the GPU (attention_varlen and its backward; cuflash/seqused.py): sequence
b uses only its first seqused_q[b] query rows and seqused_k[b] key rows of its packing. The unused
rows are filled with a large finite value (they may hold anything finite); each sequence's used rows are checked by
FlashAttention's 2x rule against the float64 reference on the used slices alone, forward and
backward, and the unused rows must come out 0 (out, dq, dk, dv) and -inf (lse). Both forward
backends, host and device (int32 / int64) lengths, one of the two alone, ALiBi per batch, dropout
(bitwise the varlen call on the split offsets), torch autograd."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import seqused, varlen
from cuflash.mask import MaskOptions
from cuflash.testing import backend_unavailable, dtype_of, fa_rule, fa_rule_grads
from tests.gpu.test_varlen_gpu import torch_packed

pytestmark = pytest.mark.gpu

LENS_Q, LENS_K = [17, 0, 113, 1, 300, 64], [40, 5, 200, 1, 300, 0]
USED_Q, USED_K = [9, 0, 113, 1, 250, 64], [40, 3, 150, 0, 299, 0]
MASKS = [dict(), dict(causal=True), dict(causal=True, alignment="top_left"), dict(window_size=(32, 8))]


def _offsets(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


# What the unused rows hold: anything finite (cuflash/seqused.py). Large, so that any weight a used
# row gave them would show; not NaN, which the Hopper kernels' tile loads would carry into the used
# rows' results (0 x NaN), as FlashAttention's do.
FILL = 1000.0


def _inputs(rng, h, hk, d, dt, fill=FILL):
    """q, k, v, dout packed with `fill` in every unused row; the host offsets."""
    import cupy

    oq, ok = _offsets(LENS_Q), _offsets(LENS_K)
    mk = lambda n, heads: rng.standard_normal((n, heads, d)).astype(np.float32)  # noqa: E731
    q, dout, k, v = mk(oq[-1], h), mk(oq[-1], h), mk(ok[-1], hk), mk(ok[-1], hk)
    for b in range(len(LENS_Q)):
        q[oq[b] + USED_Q[b]:oq[b + 1]] = dout[oq[b] + USED_Q[b]:oq[b + 1]] = fill
        k[ok[b] + USED_K[b]:ok[b + 1]] = v[ok[b] + USED_K[b]:ok[b + 1]] = fill
    return [cupy.asarray(x).astype(dt) for x in (q, k, v, dout)], oq, ok


def _lengths(kind, lens):
    import cupy

    return {"host": list(lens), "int32": cupy.asarray(lens, dtype=cupy.int32), "int64": cupy.asarray(lens)}[kind]


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask_kw", MASKS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()) or "none")
@pytest.mark.parametrize("kind", ["host", "int32", "int64"])
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2)])
def test_used_rows_match_each_sequence_and_the_rest_is_zero(h, hk, kind, mask_kw, d, dtype, backend):
    import cupy

    if why := backend_unavailable(backend):
        pytest.skip(why)
    rng = np.random.default_rng(hash((h, hk, kind, str(mask_kw), d, dtype, backend)) % 2**32)
    (q, k, v, dout), oq, ok = _inputs(rng, h, hk, d, dtype_of(dtype))
    cu_q, cu_k = cupy.asarray(oq), cupy.asarray(ok)
    used = dict(seqused_q=_lengths(kind, USED_Q), seqused_k=_lengths(kind, USED_K))
    mask = MaskOptions.of(**mask_kw)
    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((h, q.shape[0]), cupy.nan, dtype=cupy.float32)
    out, lse = varlen._forward_cupy(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), mask, None, out=out, lse=lse,
                                    backend=backend, **used)
    dq, dk, dv = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                                  **mask_kw, **used)
    scale = 1 / math.sqrt(d)
    for b in range(len(LENS_Q)):
        uq, uk = slice(int(oq[b]), int(oq[b]) + USED_Q[b]), slice(int(ok[b]), int(ok[b]) + USED_K[b])
        rest_q, rest_k = slice(uq.stop, int(oq[b + 1])), slice(uk.stop, int(ok[b + 1]))
        assert not bool(out[rest_q].astype(cupy.float32).any()) and bool(cupy.isneginf(lse[:, rest_q]).all()), b
        for g, r in ((dq, rest_q), (dk, rest_k), (dv, rest_k)):
            assert not bool(g[r].astype(cupy.float32).any()), f"sequence {b}: an unused row's gradient is not 0"
        if USED_Q[b] == 0:
            continue
        ob = out[uq][None]
        assert not bool(cupy.isnan(ob.astype(cupy.float32)).any()), f"sequence {b}: NaN from an unused row"
        if USED_K[b] == 0:
            assert bool((ob.astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse[:, uq]).all()), b
            continue
        qb, kb, vb = q[uq][None], k[uk][None], v[uk][None]
        err, pt, allowed = fa_rule(ob, qb, kb, vb, mask, scale)
        assert err <= allowed, f"sequence {b}: out err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
        res = fa_rule_grads((dq[uq][None], dk[uk][None], dv[uk][None]), qb, kb, vb, dout[uq][None], mask, scale)
        for name, (err, pt, allowed) in res.items():
            assert err <= allowed, f"sequence {b} {name}: {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"


@pytest.mark.parametrize("which", ["seqused_q", "seqused_k"])
def test_one_length_alone(which):
    """Only one of the two: the other sequence's rows all used (no NaN in them here)."""
    import cupy

    rng = np.random.default_rng(5)
    dt = dtype_of("bfloat16")
    oq, ok = _offsets(LENS_Q), _offsets(LENS_K)
    q = cupy.asarray(rng.standard_normal((oq[-1], 4, 64)).astype(np.float32)).astype(dt)
    k, v = (cupy.asarray(rng.standard_normal((ok[-1], 4, 64)).astype(np.float32)).astype(dt) for _ in range(2))
    lens = USED_Q if which == "seqused_q" else USED_K
    out = varlen.attention_varlen(q, k, v, cupy.asarray(oq), cupy.asarray(ok), max(LENS_Q), max(LENS_K),
                                  causal=True, **{which: cupy.asarray(lens, dtype=cupy.int32)})
    uq = USED_Q if which == "seqused_q" else LENS_Q
    uk = USED_K if which == "seqused_k" else LENS_K
    for b in range(len(LENS_Q)):
        rows = slice(int(oq[b]), int(oq[b]) + uq[b])
        if uq[b] and uk[b]:
            ref = varlen.attention_varlen(q[rows], k[int(ok[b]):int(ok[b]) + uk[b]], v[int(ok[b]):int(ok[b]) + uk[b]],
                                          cupy.asarray([0, uq[b]], dtype=cupy.int32),
                                          cupy.asarray([0, uk[b]], dtype=cupy.int32), uq[b], uk[b], causal=True)
            assert float(cupy.abs(out[rows].astype(cupy.float32) - ref.astype(cupy.float32)).max()) <= 2e-2, b
        assert not bool(out[rows.stop:int(oq[b + 1])].astype(cupy.float32).any()), b


def test_device_split_equals_the_numpy_rule():
    import cupy

    oq, ok = _offsets(LENS_Q), _offsets(LENS_K)
    used_q = cupy.asarray([9, 5, 200, 1, 250, 64], dtype=cupy.int32)  # 5 > 0 and 200 > 113 rows: clipped
    got = seqused.expand(cupy.asarray(oq), cupy.asarray(ok), used_q, None, len(LENS_Q))
    want = seqused.split_offsets(oq, ok, cupy.asnumpy(used_q), None)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(cupy.asnumpy(g), w)


def test_per_batch_alibi_and_dropout_are_the_split_call_bitwise():
    """ALiBi slopes per batch and dropout: the same bits as attention_varlen on the split offsets
    (the slopes repeated), forward and backward: what the docstring says the split is."""
    import cupy

    rng = np.random.default_rng(9)
    (q, k, v, dout), oq, ok = _inputs(rng, 4, 2, 64, dtype_of("float16"))
    slopes = cupy.asarray(rng.uniform(0.01, 0.5, (len(LENS_Q), 4)).astype(np.float32))
    kw = dict(causal=True, dropout_p=0.2, seed=1234, alibi_slopes=slopes)
    cu_q, cu_k = cupy.asarray(oq), cupy.asarray(ok)
    used = dict(seqused_q=USED_Q, seqused_k=cupy.asarray(USED_K, dtype=cupy.int32))
    out, lse = varlen.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), return_lse=True, **kw, **used)
    sq, sk = (cupy.asarray(x) for x in seqused.split_offsets(oq, ok, USED_Q, USED_K))
    split_kw = dict(kw, alibi_slopes=cupy.repeat(slopes, 3, axis=0))
    ref, ref_lse = varlen.attention_varlen(q, k, v, sq, sk, max(LENS_Q), max(LENS_K), return_lse=True, **split_kw)
    assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all()) and bool((lse == ref_lse).all())
    grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                             deterministic=True, **kw, **used)
    ref_grads = varlen.attention_varlen_backward(dout, q, k, v, ref, ref_lse, sq, sk, max(LENS_Q), max(LENS_K),
                                                 deterministic=True, **split_kw)
    for g, r in zip(grads, ref_grads):
        assert bool((g.view(cupy.uint16) == r.view(cupy.uint16)).all())


def test_torch_autograd_with_device_lengths():
    torch = pytest.importorskip("torch")
    import cupy

    import cuflash

    q, k, v, cu = torch_packed(torch)
    used_q, used_k = torch.tensor([10, 25], device="cuda", dtype=torch.int32), torch.tensor([15, 20])  # device, host
    out = cuflash.attention_varlen(q, k, v, cu, cu, 25, 25, causal=True, seqused_q=used_q, seqused_k=used_k)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # the same through the CuPy entry points
    cq, ck, cv, cdout, ccu = (cupy.from_dlpack(x.detach()) for x in (q, k, v, dout, cu))
    ref, lse = varlen.attention_varlen(cq, ck, cv, ccu, ccu, 25, 25, causal=True, return_lse=True,
                                       seqused_q=cupy.from_dlpack(used_q), seqused_k=used_k.numpy())
    assert bool((cupy.from_dlpack(out.detach()).view(cupy.uint16) == ref.view(cupy.uint16)).all())
    ref_grads = varlen.attention_varlen_backward(cdout, cq, ck, cv, ref, lse, ccu, ccu, 25, 25, causal=True,
                                                 seqused_q=cupy.from_dlpack(used_q), seqused_k=used_k.numpy())
    for got, want in zip(grads, ref_grads):
        assert float(cupy.abs(cupy.from_dlpack(got).astype(cupy.float32) - want.astype(cupy.float32)).max()) <= 1e-2
    assert not bool(grads[0][10:15].float().any()) and not bool(grads[1][35:40].float().any())


def test_seqused_with_a_score_mod_is_refused_before_any_launch():
    import cupy

    import cuflash

    x = cupy.zeros((8, 2, 64), dtype=cupy.float16)
    cu = cupy.asarray([0, 8], dtype=cupy.int32)
    mod = cuflash.ScoreMod(mask="kv_idx <= q_idx")
    with pytest.raises(NotImplementedError, match="score_mod"):
        varlen.attention_varlen(x, x, x, cu, cu, 8, 8, seqused_k=[4], score_mod=mod)
