"""Seeded fuzzing of attention_with_kvcache (issues 14 and 17): each case draws batch, cache
capacity, per-batch lengths (0, 1, full, random), new tokens appended, query rows, heads and GQA
group (so both the decode kernel and the prefill kernel run), head_dim (instantiated and partial),
dtype, causal / window / softcap, num_splits, host or device lengths, and a contiguous or paged
cache (page sizes 1-300, shuffled pages), then checks each batch's output by FlashAttention's 2x
rule against the float64 reference on its gathered keys, outputs poisoned and cache rows past each
length NaN. CUFLASH_FUZZ_CASES sets the count (default 48), CUFLASH_FUZZ_SEED the first seed."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from cuflash import kvcache
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule

pytestmark = pytest.mark.gpu

N_CASES = int(os.environ.get("CUFLASH_FUZZ_CASES", "48"))
FIRST_SEED = int(os.environ.get("CUFLASH_FUZZ_SEED", "0"))
REGRESSIONS: list[int] = []  # seeds that once failed, run on every pass


def draw(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    heads_kv = int(rng.choice([1, 2, 4, 8]))
    group = int(rng.choice([1, 2, 4, 8]))
    n_new = int(rng.choice([0, 0, 1, 1, 3, 9]))
    cap = int(rng.integers(max(n_new, 1), 1500))
    c = {"seed": seed, "b": int(rng.integers(1, 5)), "cap": cap, "n_new": n_new,
         "nq": max(n_new, int(rng.choice([1, 1, 2, 5]))) if n_new else int(rng.choice([1, 1, 2, 5, 17])),
         "heads_kv": heads_kv, "heads": heads_kv * group,
         "d": int(rng.choice([64, 128, 32, 96, 192, 256])) if rng.random() < 0.8 else 8 * int(rng.integers(1, 33)),
         "dtype": str(rng.choice(["bfloat16", "float16"])), "causal": bool(rng.random() < 0.6),
         "window": (-1, -1), "softcap": 0.0, "splits": int(rng.choice([0, 0, 1, 2, 5, 16])),
         "device_lengths": bool(rng.random() < 0.5),
         "page": int(rng.choice([0, 0, 1, 16, 64, 100, 256, 300])), "device_table": bool(rng.random() < 0.5)}
    if rng.random() < 0.25:
        c["window"] = (int(rng.integers(0, 300)), -1 if c["causal"] else int(rng.integers(-1, 50)))
    if rng.random() < 0.15:
        c["softcap"] = float(rng.choice([5.0, 30.0]))
    top = cap - n_new
    kinds = rng.choice(["zero", "one", "full", "random"], size=c["b"], p=[0.1, 0.1, 0.2, 0.6])
    c["lens"] = [0 if k == "zero" else min(1, top) if k == "one" else top if k == "full" else int(rng.integers(0, top + 1))
                 for k in kinds]
    return c


@pytest.mark.parametrize("seed", REGRESSIONS + list(range(FIRST_SEED, FIRST_SEED + N_CASES)))
def test_fuzz_kvcache(seed):
    import cupy

    c = draw(seed)
    rng = np.random.default_rng(seed + 10**6)
    dt = dtype_of(c["dtype"])
    b, cap, hk, h, d, n_new = c["b"], c["cap"], c["heads_kv"], c["heads"], c["d"], c["n_new"]
    mk = lambda *s: cupy.asarray(rng.standard_normal(s).astype(np.float32)).astype(dt)
    q, kc, vc = mk(b, c["nq"], h, d), mk(b, cap, hk, d), mk(b, cap, hk, d)
    lens = np.array(c["lens"])
    for i, n in enumerate(lens):
        kc.view(cupy.uint16)[i, n + n_new:] = 0xFFFF  # NaN past each final length: never read
        vc.view(cupy.uint16)[i, n + n_new:] = 0xFFFF
    kn, vn = (mk(b, n_new, hk, d), mk(b, n_new, hk, d)) if n_new else (None, None)
    kref, vref = kc.copy(), vc.copy()
    for i, n in enumerate(lens):
        if n_new:
            kref[i, n:n + n_new], vref[i, n:n + n_new] = kn[i], vn[i]
    kw = {}
    if c["page"]:
        page = c["page"]
        per = -(-cap // page)
        n_pages = b * per + 2
        table = rng.permutation(n_pages)[: b * per].reshape(b, per).astype(np.int32)
        pools = []
        for x in (kc, vc):
            pad = cupy.zeros((b, per * page, hk, d), dtype=dt)
            pad[:, :cap] = x
            pool = cupy.zeros((n_pages, page, hk, d), dtype=dt)
            pool[cupy.asarray(table.reshape(-1))] = pad.reshape(b * per, page, hk, d)
            pools.append(pool)
        kc, vc = pools
        kw["block_table"] = cupy.asarray(table) if c["device_table"] else table
    mask = MaskOptions.of(causal=c["causal"], window_size=c["window"], softcap=c["softcap"])
    lengths = cupy.asarray(lens.astype(np.int32)) if c["device_lengths"] else lens
    out, lse = kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k_new=kn, v_new=vn,
                                              causal=c["causal"], window_size=c["window"], softcap=c["softcap"],
                                              return_lse=True, num_splits=c["splits"], **kw)
    scale = 1 / math.sqrt(d)
    for i, n in enumerate(lens + n_new):
        if n == 0:
            assert bool((out[i].astype(cupy.float32) == 0).all()) and bool(cupy.isneginf(lse[i]).all()), c
            continue
        assert not bool(cupy.isnan(out[i].astype(cupy.float32)).any()), c
        err, pt, allowed = fa_rule(out[i:i + 1], q[i:i + 1], kref[i:i + 1, :n], vref[i:i + 1, :n], mask, scale)
        assert err <= allowed, f"{c}: batch {i} (length {n}): {err:.3e} > {allowed:.3e} (same-dtype {pt:.3e})"
