"""The sm90 forward's staged epilogue (kStagedO in kernels_cu/sm90/fwd.cuh) against the direct one,
bitwise, over the features it serves: a tile with two Q buffers stages O through shared memory, the
same tile with one Q buffer stores it from the fragments; the arithmetic is the same, so out and lse
must be equal bit for bit (the direct path is what the GPU test matrix checks against float64).

    python scripts/check_staged_o.py      (on a Hopper GPU; prints one line per case, exits 1 on a mismatch)

Cases: head_dim 64 and 128, bf16 and fp16, ragged seqlen_q != seqlen_k, causal or not, GQA,
windows, softcap, ALiBi, a score snippet, keyless tiles (seqlen_q > seqlen_k causal), and
variable-length batches with empty sequences; each tile order (persistent 0, 1, 2)."""
from __future__ import annotations

import dataclasses
import sys

import cupy
import numpy as np

import cuflash
from cuflash import _forward, families, varlen
from cuflash.testing import dtype_of, random_qkv


def tiles(d):
    for p in (0, 1, 2):
        staged = families.FWD_SM90.tile_cls(d, 128, 2, 2, 1, 1, 2, p)
        yield staged, dataclasses.replace(staged, q_stages=1)


def main() -> int:
    rng = np.random.default_rng(0)
    bad = 0
    slopes = cupy.asarray(rng.uniform(0.01, 0.5, 4), dtype=cupy.float32)
    snippet = cuflash.ScoreMod("score - 0.01f * (float)(q_idx - kv_idx)")
    cases = [("plain", {}), ("causal", {"causal": True}), ("window", {"window_size": (64, 16)}),
             ("softcap causal", {"softcap": 20.0, "causal": True}), ("alibi", {"alibi_slopes": slopes}),
             ("window softcap", {"window_size": (100, 0), "softcap": 30.0}), ("snippet", {"score_mod": snippet})]
    for d in (64, 128):
        for dtype in ("bfloat16", "float16"):
            for name, kw in cases:
                if dtype == "float16" and kw not in ({}, {"causal": True}):
                    continue  # fp16: the plain cases (the features' code does not depend on the dtype)
                for nq, nk, hkv in ((333, 517, 4), (700, 300, 2)):
                    q, k, v = random_qkv(rng, 2, nq, nk, 4, d, dtype_of(dtype), heads_kv=hkv)
                    for staged, direct in tiles(d):
                        a, la = _forward.forward(q, k, v, config=staged, **kw)
                        b, lb = _forward.forward(q, k, v, config=direct, **kw)
                        same = bool(cupy.array_equal(a.view(cupy.int16), b.view(cupy.int16)) and cupy.array_equal(la, lb))
                        bad += not same
                        print(f"{'ok ' if same else 'BAD'} d{d} {dtype} {name} nq={nq} nk={nk} hkv={hkv} p{staged.persistent}",
                              flush=True)
    # variable-length batches: the automatic tile, forced to the pair's (select is patched)
    real = families.select
    lens = [0, 5, 300, 0, 129, 64, 700]
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    for d in (64, 128):
        q, k, v = (cupy.asarray(rng.standard_normal((sum(lens), 4, d), dtype=np.float32)).astype(dtype_of("bfloat16"))
                   for _ in range(3))
        for causal in (False, True):
            outs = []
            for qs in (2, 1):
                varlen._plans.clear()  # plans are cached per call shape, with their tile
                families.select = (lambda fam, p, qs=qs, d=d: families.FWD_SM90.tile_cls(d, 128, 2, 2, 1, 1, qs, 2)
                                   if fam is families.FWD_SM90 else real(fam, p))
                outs.append(varlen.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal, backend="sm90",
                                                    return_lse=True))
            families.select = real
            varlen._plans.clear()
            (a, la), (b, lb) = outs
            same = bool(cupy.array_equal(a.view(cupy.int16), b.view(cupy.int16)) and cupy.array_equal(la, lb))
            bad += not same
            print(f"{'ok ' if same else 'BAD'} d{d} varlen causal={causal}", flush=True)
    print(f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
