"""User score and mask modifications (cuflash.ScoreMod, issue 13) on the GPU: snippets that rewrite
scores (a cap, a bias from an aux array, a per-head scale written as a function body) and masks (a
band, documents from int aux arrays), alone and with the built-in causal mask, windows and ALiBi,
ragged seqlens, both dtypes, head dims 64 and 128, every forward backend, against the float64
reference with FlashAttention's 2x rule (cuflash.testing applies the same modification as CuPy
functions). Outputs poisoned before each launch. Snippets that re-express softcap, ALiBi and a
window agree with the built-ins; a broken snippet raises before any launch; aux arrays are per call."""
from __future__ import annotations

import math
import time
import zlib

import numpy as np
import pytest

import cuflash
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule, random_qkv
from tests.gpu.test_forward_gpu import backend  # noqa: F401  (the fixture: every forward backend of the GPU)

pytestmark = pytest.mark.gpu

# (seqlen_q, seqlen_k, causal, window_size, with ALiBi)
CASES = [(256, 256, False, (-1, -1), False), (113, 203, True, (-1, -1), False), (203, 113, False, (-1, -1), True),
         (1, 239, False, (-1, -1), False), (300, 517, False, (100, 7), False), (640, 640, True, (-1, -1), True)]


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


def _mod(kind, rng, b, h, nq, nk):
    """(cuflash.ScoreMod, (score_fn, mask_fn) for cuflash.testing) of one kind of modification."""
    import cupy

    if kind == "cap":
        return (cuflash.ScoreMod("12.f * tanhf(score / 12.f)"), (lambda s, *_: 12 * cupy.tanh(s / 12), None))
    if kind == "bias":  # a learned (head, key) bias, float aux
        bias = cupy.asarray(rng.standard_normal((h, nk)).astype(np.float32) * 2)
        return (cuflash.ScoreMod(f"score + bias[h * {nk} + kv_idx]", aux={"bias": bias}),
                (lambda s, bb, hh, qi, kj: s + bias.astype(s.dtype)[hh, kj], None))
    if kind == "scale":  # a per-head temperature, written as a body
        w = cupy.asarray(rng.uniform(0.3, 2.0, h).astype(np.float32))
        return (cuflash.ScoreMod("const float t = temp[h];\nreturn score * t;", aux={"temp": w}),
                (lambda s, bb, hh, qi, kj: s * w.astype(s.dtype)[hh], None))
    if kind == "band":  # keys within 40 before the (bottom-right) diagonal
        off = nk - nq
        return (cuflash.ScoreMod(mask=f"kv_idx <= q_idx + {off} && q_idx + {off} - kv_idx < 40"),
                (None, lambda bb, hh, qi, kj: (kj <= qi + off) & (qi + off - kj < 40)))
    if kind == "docs":  # packed documents: a query sees the keys of its own document (int aux)
        dq = cupy.asarray(np.sort(rng.integers(0, 3, nq)).astype(np.int32))
        dk = cupy.asarray(np.sort(rng.integers(0, 3, nk)).astype(np.int32))
        return (cuflash.ScoreMod(mask="doc_q[q_idx] == doc_k[kv_idx]", aux={"doc_q": dq, "doc_k": dk}),
                (None, lambda bb, hh, qi, kj: dq[qi] == dk[kj]))
    raise ValueError(kind)


def _poisoned(q, k, v, **kw):
    import cupy
    from cuflash import _forward

    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
    return _forward.forward(q, k, v, out=out, lse=lse, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["cap", "bias", "scale", "band", "docs"])
@pytest.mark.parametrize("nq,nk,causal,window,alibi", CASES)
def test_score_mod_forward(nq, nk, causal, window, alibi, kind, d, dtype, backend):  # noqa: F811
    import cupy

    case = (nq, nk, causal, window, alibi, kind, d, dtype, backend)
    rng = np.random.default_rng(_seed(*case))
    b, h, h_kv = 2, 4, 2  # GQA
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of(dtype), heads_kv=h_kv)
    mod, fns = _mod(kind, rng, b, h, nq, nk)
    slopes = cupy.asarray((2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)) if alibi else None
    mask = MaskOptions.of(causal=causal, window_size=window)
    out, lse = _poisoned(q, k, v, mask=mask, alibi_slopes=slopes, score_mod=mod, backend=backend)
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any()) and not bool(cupy.isnan(lse).any())
    scale = 1 / math.sqrt(d)
    err, pt, allowed = fa_rule(out, q, k, v, mask, scale, alibi_slopes=slopes, mods=fns)
    assert err <= allowed, f"max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
    if kind in ("bias", "scale", "band") and nk > 40:  # the modification matters
        err_plain, _, _ = fa_rule(out, q, k, v, mask, scale, alibi_slopes=slopes)
        assert err_plain > 4 * allowed


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_snippets_that_re_express_built_ins_agree_with_them(dtype, backend):  # noqa: F811
    """A cap on tanh.approx (the built-in's instruction), ALiBi and a window written as snippets give
    the built-ins' results within the 2x rule of the same reference, and the cap nearly the bits."""
    import cupy
    from cuflash import _forward

    rng = np.random.default_rng(11)
    nq, nk, h = 300, 420, 4
    q, k, v = random_qkv(rng, 2, nq, nk, h, 128, dtype_of(dtype))
    scale = 1 / math.sqrt(128)
    off = nk - nq
    cap = cuflash.ScoreMod("20.f * tanh_approx(score / 20.f)")  # cuflash's own helpers are in scope
    built = _forward.forward(q, k, v, mask=MaskOptions.of(causal=True, softcap=20.0), backend=backend)[0]
    mine = _forward.forward(q, k, v, mask=MaskOptions.of(causal=True), score_mod=cap, backend=backend)[0]
    for out in (built, mine):
        err, _, allowed = fa_rule(out, q, k, v, MaskOptions.of(causal=True, softcap=20.0), scale)
        assert err <= allowed
    slopes = cupy.asarray(np.float32([0.5, 0.25, 0.125, 0.0625]))
    alibi = cuflash.ScoreMod(f"score - slopes[h] * fabsf((float)(q_idx + {off} - kv_idx))", aux={"slopes": slopes})
    mine = _forward.forward(q, k, v, mask=MaskOptions.of(), score_mod=alibi, backend=backend)[0]
    err, _, allowed = fa_rule(mine, q, k, v, MaskOptions.of(), scale, alibi_slopes=slopes)
    assert err <= allowed
    band = cuflash.ScoreMod(mask=f"kv_idx <= q_idx + {off} + 5 && kv_idx >= q_idx + {off} - 60")
    mine = _forward.forward(q, k, v, mask=MaskOptions.of(), score_mod=band, backend=backend)[0]
    err, _, allowed = fa_rule(mine, q, k, v, MaskOptions.of(window_size=(60, 5)), scale)
    assert err <= allowed


def test_a_broken_snippet_raises_before_any_launch_and_names_its_line():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 64, 64, 2, 64, dtype_of("bfloat16"))
    with pytest.raises(cuflash.ScoreModError, match=r"score_mod\(2\)"):
        cuflash.attention(q, k, v, score_mod=cuflash.ScoreMod("float x = score;\nreturn x + nope;"))
    out = cuflash.attention(q, k, v, score_mod=cuflash.ScoreMod("score * 0.5f"))  # the package still works
    err, _, allowed = fa_rule(out, q, k, v, False, 1 / 8, mods=(lambda s, *_: s * 0.5, None))
    assert err <= allowed


def test_aux_arrays_are_per_call_and_the_kernel_per_snippet():
    """Two ScoreMods with one snippet and different aux arrays share a kernel and read their own data."""
    import cupy

    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 128, 128, 2, 64, dtype_of("float16"))
    outs = []
    for w in ([0.5, 2.0], [2.0, 0.5]):
        temp = cupy.asarray(np.float32(w))
        out = cuflash.attention(q, k, v, score_mod=cuflash.ScoreMod("score * temp[h]", aux={"temp": temp}))
        err, _, allowed = fa_rule(out, q, k, v, False, 1 / 8, mods=(lambda s, b, h, qi, kj, t=temp: s * t.astype(s.dtype)[h], None))
        assert err <= allowed
        outs.append(out)
    assert float(cupy.abs(outs[0].astype(cupy.float32) - outs[1].astype(cupy.float32)).max()) > 1e-2


def test_a_new_snippet_compiles_cold_in_seconds():
    """A new snippet's kernel (its tile's ptxas check and the load) in a few seconds. Issue 13's bar
    (2 s) is measured by scripts/bench_score_mod.py in a quiet process: here the other xdist workers
    compile at the same time (2.5 s measured so on the H200's 16 cores)."""
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 1, 256, 256, 2, 128, dtype_of("bfloat16"))
    mod = cuflash.ScoreMod(f"score + {rng.uniform():.6f}f * (float)(kv_idx % 7)")  # never compiled before
    t = time.perf_counter()
    cuflash.attention(q, k, v, score_mod=mod)
    import cupy

    cupy.cuda.Device().synchronize()
    took = time.perf_counter() - t
    print(f"cold snippet compile + first call: {took:.2f} s")
    assert took <= 6.0, f"{took:.2f} s"


def test_torch_tensors_forward_only():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 96, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    temp = torch.tensor([0.5, 1.5], device="cuda")
    mod = cuflash.ScoreMod("score * temp[h]", aux={"temp": temp})  # a torch aux array, zero-copy
    out = cuflash.attention(q, k, v, score_mod=mod)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    import cupy

    qc, kc, vc = (cupy.from_dlpack(x) for x in (q, k, v))
    tc = cupy.from_dlpack(temp)
    err, _, allowed = fa_rule(cupy.from_dlpack(out), qc, kc, vc, False, 1 / 8,
                              mods=(lambda s, b, h, qi, kj: s * tc.astype(s.dtype)[h], None))
    assert err <= allowed
    qg = q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward yet"):
        cuflash.attention(qg, k, v, score_mod=mod)
    with torch.no_grad():
        cuflash.attention(qg, k, v, score_mod=mod)
