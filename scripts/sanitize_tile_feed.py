"""The sm90 forward's drawn tile order (persistent 2) on small calls, for compute-sanitizer (memcheck,
racecheck, synccheck): a dense causal call, a GQA one, a causal one whose top tiles see no key
(seqlen_q > seqlen_k: keyless tiles between tiles with keys in one CTA's sequence), a
ragged variable-length batch with empty sequences, each launched twice (the second finds the
counter the first left at 0). Each also on a two-consumer tile with two Q buffers, whose epilogue
stages O in its Q image (kStagedO in kernels_cu/sm90/fwd.cuh)."""
from __future__ import annotations

import dataclasses

import cupy
import numpy as np

from cuflash import _forward, families, varlen
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, random_qkv

rng = np.random.default_rng(0)
bf = dtype_of("bfloat16")
for d, hkv, causal, nq, nk in ((128, 4, True, 700, 900), (64, 2, False, 700, 900), (128, 2, True, 900, 300)):
    default = dataclasses.replace(families.FWD_SM90.defaults[d][0], persistent=2)
    staged = dataclasses.replace(default, consumers=2, block_k=128, stages=2, q_stages=2)
    q, k, v = random_qkv(rng, 2, nq, nk, 4, d, bf, heads_kv=hkv)
    for tile in (default, staged):
        for _ in range(2):
            _forward.forward(q, k, v, mask=MaskOptions.of(causal=causal), config=tile)
real = families.select
lens = [0, 5, 300, 0, 129, 64]
cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
q, k, v = (cupy.asarray(rng.standard_normal((sum(lens), 2, 128), dtype=np.float32)).astype(bf) for _ in range(3))
for q_stages in (1, 2):
    families.select = (lambda fam, p, qs=q_stages: dataclasses.replace(real(fam, p), persistent=2, consumers=2, block_k=128,
                                                                       stages=2, q_stages=qs)
                       if fam is families.FWD_SM90 else real(fam, p))
    for causal in (False, True):
        varlen.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal, backend="sm90")
cupy.cuda.runtime.deviceSynchronize()
print("ok")
