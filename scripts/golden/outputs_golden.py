"""Golden outputs for the restructuring guard (issue 9): bitwise hashes of every kernel's outputs on
a fixed set of shapes and inputs, recorded before the restructuring and checked after each step.

    python scripts/golden/outputs_golden.py record tests/golden/outputs.json   (on the GPU)
    python scripts/golden/outputs_golden.py check  tests/golden/outputs.json

Cases cover v2 and v1 forwards (every selectable config), the backward with atomic dQ (dK and dV
only: atomics make dQ order-dependent) and deterministic dQ (all three), and the dropout variants,
in both dtypes, both head dims, causal and not, at awkward seqlens. Inputs come from NumPy's
seeded generator on the host, so every run sees the same bits. The adapters in `Api` are the only
part that follows the library's internal API; case names never change.
"""
from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

SHAPES = ((2, 113, 203, 3), (1, 256, 256, 2), (1, 1000, 1000, 2))  # (batch, seqlen_q, seqlen_k, heads)
DTYPES = ("bfloat16", "float16")
SEED = 1234


class Api:
    """What the cases need from the library: config lists and entry points with an explicit config."""

    def __init__(self):
        from cuflash import _backward, _forward, _forward_v1, families

        self.fam, self.f, self.f1, self.b = families, _forward, _forward_v1, _backward

    def configs(self, kind: str, d: int):
        return [c for c in self.fam.get(kind).selectable() if c.head_dim == d]

    def default(self, kind: str, d: int):
        return self.fam.get(kind).default(d)

    @staticmethod
    def label(cfg) -> str:
        return f"q{cfg.block_q}_k{cfg.block_k}_w{cfg.warps}_s{cfg.stages}"

    def fwd(self, kind, q, k, v, causal, drop, cfg, out, lse):
        fn = self.f.forward if kind == "fwd" else self.f1.forward_v1
        # the golden set is the mma.sync kernels': on a Hopper GPU the default forward would be sm90
        return fn(q, k, v, causal=causal, dropout_p=drop[0], seed=drop[1], config=cfg, out=out, lse=lse,
                  backend="sm80")

    def bwd(self, dout, q, k, v, out, lse, causal, drop, deterministic, cfg, dq_cfg):
        return self.b.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                               dropout_p=drop[0], seed=drop[1], config=cfg, dq_config=dq_cfg)


def _sha(a) -> str:
    import cupy

    return hashlib.sha256(cupy.ascontiguousarray(a).get().tobytes()).hexdigest()[:16]


def _inputs(shape, d, dtype, tag):
    """q, k, v, dout from a generator seeded by the case's name."""
    import cupy

    b, nq, nk, h = shape
    rng = np.random.default_rng(int(hashlib.sha256(f"{SEED}/{tag}".encode()).hexdigest()[:8], 16))
    dt = cupy.float16 if dtype == "float16" else __import__("ml_dtypes").bfloat16

    def mk(n):
        return cupy.asarray(rng.standard_normal((b, n, h, d)).astype(np.float32)).astype(dt)

    return mk(nq), mk(nk), mk(nk), mk(nq)


def run(api: Api) -> dict:
    import cupy

    res = {}
    for d in (64, 128):
        for dtype in DTYPES:
            for shape in SHAPES:
                for causal in (False, True):
                    for drop in ((0.0, None), (0.17, 987654321)):
                        dname = "drop" if drop[0] else "plain"
                        base = f"{dtype}/d{d}/{'x'.join(map(str, shape))}/{'causal' if causal else 'full'}/{dname}"
                        q, k, v, dout = _inputs(shape, d, dtype, base)
                        b, nq, nk, h = shape
                        for kind in ("fwd", "fwd_v1"):
                            cfgs = api.configs(kind, d)
                            if drop[0]:  # dropout: one explicit config, and v2's own pick
                                cfgs = cfgs[:1] + ([None] if kind == "fwd" else [])
                            for cfg in cfgs:
                                out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
                                lse = cupy.full((b, h, nq), cupy.nan, dtype=cupy.float32)
                                o, l = api.fwd(kind, q, k, v, causal, drop, cfg, out, lse)
                                name = f"{kind}/{api.label(cfg) if cfg else 'default'}/{base}"
                                res[name] = {"out": _sha(o), "lse": _sha(l)}
                        # backward on the default v2 forward's outputs
                        o, l = api.fwd("fwd", q, k, v, causal, drop, api.default("fwd", d), None, None)
                        for cfg in api.configs("bwd", d):
                            dq, dk, dv = api.bwd(dout, q, k, v, o, l, causal, drop, False, cfg, None)
                            res[f"bwd/{api.label(cfg)}/{base}"] = {"dk": _sha(dk), "dv": _sha(dv)}
                        for dq_cfg in api.configs("bwd_dq", d):
                            dq, dk, dv = api.bwd(dout, q, k, v, o, l, causal, drop, True, api.default("bwd", d), dq_cfg)
                            res[f"bwd_dq/{api.label(dq_cfg)}/{base}"] = {"dq": _sha(dq), "dk": _sha(dk), "dv": _sha(dv)}
    cupy.cuda.runtime.deviceSynchronize()
    return res


def main(argv):
    mode, path = argv[1], argv[2]
    now = run(Api())
    if mode == "record":
        with open(path, "w") as f:
            json.dump(now, f, indent=0, sort_keys=True)
        print(f"recorded {len(now)} cases to {path}")
        return 0
    with open(path) as f:
        golden = json.load(f)
    bad = [k for k in golden if now.get(k) != golden[k]]
    missing = [k for k in golden if k not in now]
    print(f"{len(golden) - len(bad)}/{len(golden)} golden cases bitwise equal; {len(missing)} missing")
    for k in bad[:40]:
        print("DIFF:", k, golden[k], now.get(k))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
