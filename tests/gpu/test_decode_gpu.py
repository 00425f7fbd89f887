"""The decode kernel (families.DECODE, kernels_cu/sm80/decode.cuh) behind attention_with_kvcache:
a GQA group's query heads packed into one tile. Each case runs twice, on the decode kernel and
forced onto the prefill kernel, both checked per batch by FlashAttention's 2x rule against the
float64 reference on the batch's gathered keys; lengths 0, 1, key-tile boundaries +-1 and the
capacity; groups 1 to 16 rows; windows, softcap, splits; outputs poisoned before the launch and
cache rows past each length NaN (never read)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import kvcache
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule

pytestmark = pytest.mark.gpu

CAP = 1000


def _run(q, kc, vc, lens, mask, num_splits, decode: bool, monkeypatch):
    import cupy

    with monkeypatch.context() as m:
        if not decode:
            m.setattr(kvcache, "decode_problem", lambda p: "forced onto the prefill kernel")
        kvcache._plans.clear()
        out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
        lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
        res = kvcache._forward_cupy(q, kc, vc, lens, None, None, mask, None, out=out, lse=lse, num_splits=num_splits)
    kvcache._plans.clear()
    return res


def _case(rng, batch, nq, h, hk, d, dtype, lens):
    import cupy

    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    q = mk(batch, nq, h, d)
    kc, vc = mk(batch, CAP, hk, d), mk(batch, CAP, hk, d)
    for b, n in enumerate(lens):
        kc.view(cupy.uint16)[b, n:] = 0xFFFF  # NaN in fp16 and bf16
        vc.view(cupy.uint16)[b, n:] = 0xFFFF
    return q, kc, vc


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,hk,nq", [(32, 8, 1), (32, 8, 4), (8, 8, 1), (16, 1, 1), (8, 1, 2), (4, 4, 16), (6, 2, 5)])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (200, -1), 0.0), (False, (-1, -1), 30.0)])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_decode_matches_reference_and_prefill(num_splits, causal, window, softcap, h, hk, nq, d, dtype, monkeypatch):
    import cupy

    rng = np.random.default_rng(hash((num_splits, causal, window, softcap, h, hk, nq, d, dtype)) % 2**32)
    lens = np.array([0, 1, 63, 64, 65, 511, CAP])
    q, kc, vc = _case(rng, len(lens), nq, h, hk, d, dtype_of(dtype), lens)
    mask = MaskOptions.of(causal=causal, window_size=window, softcap=softcap)
    assert kvcache.decode_problem(_problem(q, kc, vc, mask)) is None
    out, lse = _run(q, kc, vc, lens, mask, num_splits, True, monkeypatch)
    ref_out, ref_lse = _run(q, kc, vc, lens, mask, num_splits, False, monkeypatch)
    scale = 1 / math.sqrt(d)
    for b, n in enumerate(lens):
        if n == 0:
            assert bool((out[b].astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse[b]).all())
            continue
        assert not bool(cupy.isnan(out[b].astype(cupy.float32)).any()) and not bool(cupy.isnan(lse[b]).any())
        err, pt, allowed = fa_rule(out[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], mask, scale)
        assert err <= allowed, f"batch {b} (length {n}): {err:.3e} > {allowed:.3e} (same-dtype {pt:.3e})"
        diff = float(cupy.abs(out[b].astype(cupy.float32) - ref_out[b].astype(cupy.float32)).max())
        assert diff <= allowed, f"batch {b}: decode and prefill differ by {diff:.3e} > {allowed:.3e}"
        fin = cupy.isfinite(ref_lse[b])
        assert bool((cupy.isfinite(lse[b]) == fin).all())
        assert float(cupy.abs(cupy.where(fin, lse[b] - ref_lse[b], 0)).max()) <= 1e-3


@pytest.mark.parametrize("d", [32, 96, 192, 256])
def test_decode_other_head_dims(d, monkeypatch):
    test_decode_matches_reference_and_prefill(0, True, (-1, -1), 0.0, 32, 8, 1, d, "bfloat16", monkeypatch)


def _problem(q, kc, vc, mask):
    import dataclasses

    from cuflash import problem

    infos = [problem.describe(x, n) for x, n in ((q, "q"), (kc, "k_cache"), (vc, "v_cache"))]
    return dataclasses.replace(problem.resolve_forward(*infos, mask, None), seqused_k=True)


def test_rows_past_the_tile_and_other_head_dims_take_the_prefill_kernel():
    import cupy

    rng = np.random.default_rng(7)
    q, kc, vc = _case(rng, 2, 5, 16, 4, 64, dtype_of("bfloat16"), [10, 20])  # 4 x 5 = 20 rows
    assert "20 rows" in kvcache.decode_problem(_problem(q, kc, vc, MaskOptions.of()))
    q2, kc2, vc2 = _case(rng, 2, 1, 8, 8, 80, dtype_of("bfloat16"), [10, 20])  # head_dim 80: no instance
    assert "head_dim 80" in kvcache.decode_problem(_problem(q2, kc2, vc2, MaskOptions.of()))
    for args in ((q, kc, vc), (q2, kc2, vc2)):
        out = kvcache.attention_with_kvcache(*args, cache_seqlens=[10, 20])
        assert not bool(cupy.isnan(out.astype(cupy.float32)).any())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"causal": True, "alignment": "top_left"},
                                {"window_size": (50, 0), "softcap": 20.0}, {"alibi": True}],
                         ids=["none", "causal", "top_left", "window-softcap", "alibi"])
@pytest.mark.parametrize("nq,h,hk,nk", [(1, 32, 8, 3000), (4, 16, 4, 777), (16, 4, 4, 100), (2, 8, 1, 5000)])
def test_dense_calls_of_decode_shape(nq, h, hk, nk, kw, dtype):
    """cuflash.attention with few query rows per K/V head (a decoding step handing it the whole
    cache) runs the decode kernel (_forward._decode_route; its plan holds every batch's length,
    seqlen_k), checked by the 2x rule against float64, outputs poisoned; equal within the rule to
    the prefill kernel forced; the backward of its (out, lse) meets the rule too."""
    import cupy

    import cuflash
    from cuflash import _backward, _forward, families, problem
    from cuflash.testing import fa_rule_grads

    rng = np.random.default_rng(nq * 7919 + nk)
    mk = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype_of(dtype))  # noqa: E731
    q, k, v, dout = mk(2, nq, h, 128), mk(2, nk, hk, 128), mk(2, nk, hk, 128), mk(2, nq, h, 128)
    kw = dict(kw)
    slopes = cupy.asarray(rng.uniform(0.01, 0.3, h), dtype=cupy.float32) if kw.pop("alibi", False) else None
    mask = MaskOptions.of(**kw)
    p = problem.resolve_forward(*(problem.describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))), mask, None)
    assert _forward._decode_route(families.FORWARDS, p, None)
    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((2, h, nq), cupy.nan, dtype=cupy.float32)
    out, lse = _forward.forward(q, k, v, mask=mask, out=out, lse=lse, alibi_slopes=slopes)
    scale = 1 / math.sqrt(128)
    err, pt, allowed = fa_rule(out, q, k, v, mask, scale, alibi_slopes=slopes)
    assert err <= allowed, f"{err:.3e} > {allowed:.3e} (same-dtype {pt:.3e})"
    ref_out, ref_lse = _forward.forward(q, k, v, mask=mask, alibi_slopes=slopes, backend="sm80")
    fin = cupy.isfinite(ref_lse)
    assert bool((cupy.isfinite(lse) == fin).all())
    assert float(cupy.abs(cupy.where(fin, lse - ref_lse, 0)).max()) < 1e-3
    grads = _backward.backward(dout, q, k, v, out, lse, mask=mask, alibi_slopes=slopes)
    for name, (err, pt, allowed) in fa_rule_grads(grads, q, k, v, dout, mask, scale, alibi_slopes=slopes).items():
        assert err <= allowed, name
    assert cuflash.attention(q, k, v, alibi_slopes=slopes, **kw).shape == q.shape
