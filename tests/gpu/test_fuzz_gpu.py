"""Seeded property-based fuzzing of the public API (issue 14): each case draws a shape (batch, seqlens
including 0 and 1, heads and GQA group, head_dim), dtype, layout (contiguous, or slices of a packed
qkv array, or heads-major strides), mask (causal, window, alignment), softmax_scale, algorithm,
forward backend, dropout, ALiBi slopes and determinism, then checks forward and backward against the float64
reference by FlashAttention's 2x rule, outputs poisoned first.

CUFLASH_FUZZ_CASES sets how many cases (default 64: a quick pass; scripts/gpu_run.sh runs
thousands), CUFLASH_FUZZ_SEED the first seed. A failing seed goes into REGRESSIONS, which always run.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule, fa_rule_grads

pytestmark = pytest.mark.gpu

N_CASES = int(os.environ.get("CUFLASH_FUZZ_CASES", "64"))
FIRST_SEED = int(os.environ.get("CUFLASH_FUZZ_SEED", "0"))
REGRESSIONS: list[int] = []  # seeds that once failed, run on every pass


def _head_dim(rng) -> int:
    """Mostly the instantiated head dims, sometimes any multiple of 8 up to 256 (run on the next
    instantiated one with the columns past it masked)."""
    if rng.random() < 0.75:
        return int(rng.choice([64, 128, 32, 96, 192, 256]))
    return 8 * int(rng.integers(1, 33))


def _seqlen(rng) -> int:
    r = rng.random()
    if r < 0.04:
        return 0
    if r < 0.12:
        return 1
    return int(rng.integers(2, 700))


def draw(seed: int) -> dict:
    """One case's parameters, a pure function of the seed (printed on failure)."""
    rng = np.random.default_rng(seed)
    heads_kv = int(rng.choice([1, 2, 3]))
    group = int(rng.choice([1, 1, 2, 4]))
    c = {
        "seed": seed,
        "b": int(rng.choice([0, 1, 1, 2, 3])) if rng.random() < 0.05 else int(rng.integers(1, 4)),
        "nq": _seqlen(rng), "nk": _seqlen(rng), "heads_kv": heads_kv, "heads": heads_kv * group,
        "d": _head_dim(rng), "dtype": str(rng.choice(["bfloat16", "float16"])),
        "layout": str(rng.choice(["contiguous", "packed", "heads_major"])),
        "causal": bool(rng.random() < 0.5), "alignment": str(rng.choice(["bottom_right", "top_left"])),
        "window": (-1, -1), "scale": None, "algorithm": "v2", "backend": None,
        "dropout_p": 0.0, "deterministic": bool(rng.random() < 0.25), "softcap": 0.0,
    }
    if rng.random() < 0.3:
        c["window"] = (int(rng.choice([-1, 0, 17, 200])), int(rng.choice([-1, 0, 5, 300])))
    if rng.random() < 0.3:
        c["scale"] = float(rng.uniform(0.02, 0.3))
    if rng.random() < 0.15:
        c["softcap"] = float(rng.choice([5.0, 30.0]))
    if rng.random() < 0.15 and c["d"] <= 128:  # v1 has no kernels past head_dim 128
        c["algorithm"] = "v1"
    elif rng.random() < 0.3:
        c["backend"] = "sm80"
    if rng.random() < 0.15:
        c["dropout_p"] = float(rng.choice([0.1, 0.3]))
    if c["layout"] == "packed":
        c["nk"] = c["nq"]  # a packed qkv array has one seqlen
    # drawn last, so the seeds above keep the cases they had before ALiBi joined
    c["alibi"] = None
    if rng.random() < 0.15 and c["algorithm"] == "v2":  # (heads,) slopes, or (batch, heads)
        c["alibi"] = str(rng.choice(["heads", "batch_heads"])) if c["b"] else "heads"
    return c


def _slopes(c):
    """ALiBi's slopes of the case (float32 CuPy), or None: geometric per head, varied per batch."""
    import cupy

    if c["alibi"] is None:
        return None
    s = 2.0 ** (-8.0 * (np.arange(c["heads"]) + 1) / c["heads"])
    if c["alibi"] == "batch_heads":
        s = s[None, :] * (1 + 0.5 * np.arange(c["b"]))[:, None]
    return cupy.asarray(s.astype(np.float32))


def _arrays(c):
    """q, k, v, dout as the case's layout lays them out (values N(0, 1) in the dtype)."""
    import cupy

    rng = cupy.random.default_rng(c["seed"])
    dt = dtype_of(c["dtype"])
    b, nq, nk, h, hkv, d = c["b"], c["nq"], c["nk"], c["heads"], c["heads_kv"], c["d"]

    def rand(shape):
        return rng.standard_normal(shape, dtype=cupy.float32).astype(dt)

    if c["layout"] == "packed":  # (b, n, h + 2 hkv, d): q, k, v are slices along the heads
        qkv = rand((b, nq, h + 2 * hkv, d))
        q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hkv], qkv[:, :, h + hkv:]
    elif c["layout"] == "heads_major":  # (b, h, n, d) memory seen as (b, n, h, d)
        q, k, v = (rand((b, hh, n, d)).transpose(0, 2, 1, 3) for hh, n in ((h, nq), (hkv, nk), (hkv, nk)))
    else:
        q, k, v = rand((b, nq, h, d)), rand((b, nk, hkv, d)), rand((b, nk, hkv, d))
    return q, k, v, rand((b, nq, h, d))


def _keep_scale(c):
    import cupy

    from cuflash.philox import dropout_keep_mask, dropout_scale

    if not c["dropout_p"]:
        return None
    m = dropout_keep_mask(c["seed"], c["b"], c["heads"], c["nq"], c["nk"], c["dropout_p"])
    return cupy.asarray(m.astype(np.float64) * dropout_scale(c["dropout_p"]))


def check_case(c: dict) -> None:
    import cupy

    import cuflash

    q, k, v, dout = _arrays(c)
    mask = MaskOptions.of(causal=c["causal"], window_size=c["window"], alignment=c["alignment"], softcap=c["softcap"])
    scale = c["scale"] if c["scale"] is not None else 1 / math.sqrt(c["d"])
    slopes = _slopes(c)
    kw = dict(causal=c["causal"], window_size=c["window"], alignment=c["alignment"], softmax_scale=c["scale"],
              softcap=c["softcap"], alibi_slopes=slopes,
              dropout_p=c["dropout_p"], seed=c["seed"] if c["dropout_p"] else None)
    out, lse = cuflash.attention(q, k, v, return_lse=True, algorithm=c["algorithm"], backend=c["backend"], **kw)
    assert out.shape == q.shape and lse.shape == (c["b"], c["heads"], c["nq"])
    if min(c["b"], c["nq"], c["nk"]) == 0:  # no key at all: out 0; gradients 0 (tests/gpu/test_empty_gpu.py)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=c["deterministic"], **kw)
        for x in (out, *grads):
            assert not bool(x.astype(cupy.float32).any())
        return
    z = _keep_scale(c)
    err, pt, allowed = fa_rule(out, q, k, v, mask, scale, keep_scale=z, alibi_slopes=slopes)
    assert err <= allowed, f"out: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=c["deterministic"], **kw)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert not bool(cupy.isnan(g.astype(cupy.float32)).any())
    for name, (err, pt, allowed) in fa_rule_grads(grads, q, k, v, dout, mask, scale, keep_scale=z,
                                                  alibi_slopes=slopes).items():
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"


def test_draws_cover_the_space():
    """Over the default pass the draws reach every layout, both dtypes, both head dims, GQA, empty and
    one-token sequences, windows, dropout, v1 and a forced backend (a CPU-cheap check of the drawer)."""
    cases = [draw(s) for s in range(FIRST_SEED, FIRST_SEED + max(N_CASES, 256))]
    seen = lambda key, val: any(c[key] == val for c in cases)  # noqa: E731
    assert all(seen("layout", x) for x in ("contiguous", "packed", "heads_major"))
    assert seen("nq", 0) and seen("nk", 1) and seen("algorithm", "v1") and seen("backend", "sm80")
    assert any(c["heads"] > c["heads_kv"] for c in cases) and any(c["dropout_p"] for c in cases)
    assert any(c["window"] != (-1, -1) for c in cases) and any(c["softcap"] for c in cases)
    assert any(c["d"] % 32 for c in cases) and any(c["d"] == 256 for c in cases)
    assert seen("alibi", "heads") and seen("alibi", "batch_heads")


@pytest.mark.parametrize("seed", REGRESSIONS + list(range(FIRST_SEED, FIRST_SEED + N_CASES)))
def test_fuzz(seed):
    c = draw(seed)
    try:
        check_case(c)
    except (AssertionError, Exception) as e:
        raise AssertionError(f"fuzz case {c}: {type(e).__name__}: {e}") from e
