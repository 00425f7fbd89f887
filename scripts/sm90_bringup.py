"""Bring-up harness for the sm90 kernels: runs one explicit tile through the library's own launch
plan (families.FWD_SM90.plan, cuflash._backward's plan with an Sm90BwdConfig), built once per
shape, bypassing only the automatic choice of family and tile; checks outputs against the float64
oracle (cuflash.testing.fa_rule) and times each tile next to the sm80 kernels and PyTorch SDPA
(flash, cuDNN) in the same run.

    python scripts/sm90_bringup.py check            # correctness matrix
    python scripts/sm90_bringup.py bench            # timing table
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, ".")
import cupy  # noqa: E402

from cuflash import problem, testing  # noqa: E402
from cuflash._forward import forward as fwd_sm80  # noqa: E402
from cuflash.mask import MaskOptions  # noqa: E402

_plans = {}


def _plan(key, build, tiny_grid=False):
    """The launch plan of `key`, built once (so timings hold no host work but the launch); with
    tiny_grid the plan's persistent grid is 3 CTAs (many tiles per CTA: a check, never timed)."""
    if key not in _plans:
        if tiny_grid:
            from cuflash import _forward_sm90, device

            real = device.query(0)
            with _patched(_forward_sm90.device, "query", lambda *_a, **_k: dataclasses.replace(real, sm_count=3)):
                _plans[key] = build()
        else:
            _plans[key] = build()
    return _plans[key]


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _arrays_key(*xs):
    return tuple((x.shape, x.strides, x.dtype.name) for x in xs)


def run(cfg, q, k, v, causal, scale=None, dropout_p=0.0, seed=0, out=None, lse=None):
    """cfg: Sm90FwdConfig fields (head_dim, block_k, consumers, stages, pingpong, overlap,
    persistent); persistent 2 = the persistent kernel on a 3-CTA grid (check only)."""
    from cuflash.families import FWD_SM90
    from cuflash.tiles import Sm90FwdConfig

    tiny = cfg[6] == 2
    tile = Sm90FwdConfig(*cfg[:6], 1, 1 if tiny else cfg[6])  # q_stages 1: the CFGS predate the axis
    drop = problem.resolve_dropout(dropout_p, seed) if dropout_p else None

    def build():
        infos = (problem.describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        p = problem.resolve_forward(*infos, MaskOptions.of(causal=causal), scale, drop)
        FWD_SM90.check_explicit(tile, p.features)
        return FWD_SM90.plan(p, tile, q.dtype)

    plan = _plan(("fwd", tile, tiny, _arrays_key(q, k, v), causal, scale, drop is not None), build, tiny)
    return plan.run((q, k, v, out, lse), None if drop is None else drop.kernel_args)


CFGS = {128: [(128, 128, 2, 2, 1, 1, 1), (128, 128, 2, 2, 1, 1, 0), (128, 176, 2, 2, 1, 1, 1), (128, 176, 2, 2, 1, 1, 0),
              (128, 128, 2, 2, 0, 1, 1), (128, 128, 2, 2, 0, 0, 1), (128, 96, 2, 2, 1, 1, 1), (128, 128, 2, 3, 1, 1, 1)],
        64: [(64, 128, 2, 2, 1, 1, 1), (64, 128, 3, 2, 1, 1, 1), (64, 128, 3, 2, 1, 1, 0), (64, 192, 2, 2, 1, 1, 1),
             (64, 128, 2, 2, 0, 0, 1), (64, 96, 3, 2, 1, 1, 1)]}


def check():
    rng = np.random.default_rng(0)
    shapes = [(1, 128, 128, 2, False), (2, 1, 1, 3, False), (1, 17, 300, 2, True), (1, 300, 17, 2, True),
              (2, 257, 391, 2, False), (1, 1000, 1000, 2, True), (1, 511, 77, 1, False), (1, 64, 1500, 1, True)]
    fails = 0
    for d, cfgs in CFGS.items():
        for cfg in [*cfgs[:3], *[(*c[:6], 2) for c in cfgs[:2]]]:
            for dtname in ("bfloat16", "float16"):
                dt = testing.dtype_of(dtname)
                for (b, nq, nk, h, causal) in shapes:
                    q, k, v = testing.random_qkv(rng, b, nq, nk, h, d, dt)
                    out = cupy.full_like(q, float("nan"))
                    lse = cupy.full((b, h, nq), float("nan"), cupy.float32)
                    run(cfg, q, k, v, causal, out=out, lse=lse)
                    cupy.cuda.Device().synchronize()
                    scale = 1 / math.sqrt(d)
                    err, pt, allowed = testing.fa_rule(out, q, k, v, causal, scale)
                    _, lref = testing.naive(q, k, v, causal, scale, cupy.float64)
                    fin = cupy.isfinite(lref)
                    lerr = float(cupy.where(fin, cupy.abs(lse.astype(cupy.float64) - cupy.where(fin, lref, 0)), 0).max())
                    lfin = bool(cupy.all(cupy.isfinite(lse) == cupy.isfinite(lref)))
                    ok = err <= allowed and lerr < 1e-3 and lfin
                    fails += not ok
                    if not ok or (b, nq) == (1, 1000):
                        print(f"{'ok  ' if ok else 'FAIL'} cfg={cfg} {dtname} b{b} nq{nq} nk{nk} h{h} causal={causal}: "
                              f"err {err:.2e} pt {pt:.2e} allowed {allowed:.2e} lse err {lerr:.2e} fin {lfin}", flush=True)
            # dropout: same mask as the sm80 kernel -> compare with it
            for dtname in ("bfloat16",):
                dt = testing.dtype_of(dtname)
                q, k, v = testing.random_qkv(rng, 2, 333, 555, 2, d, dt)
                for causal in (False, True):
                    o9, l9 = run(cfg, q, k, v, causal, dropout_p=0.17, seed=1234)
                    o8, l8 = fwd_sm80(q, k, v, causal=causal, dropout_p=0.17, seed=1234)
                    e = float(cupy.abs(o9.astype(cupy.float32) - o8.astype(cupy.float32)).max())
                    el = float(cupy.abs(l9 - l8).max())
                    ok = e < 2e-2 and el < 1e-3
                    fails += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} cfg={cfg} dropout causal={causal}: |o9-o8| {e:.2e} |lse| {el:.2e}", flush=True)
    print("FAILS", fails)


def timeit(f, reps=15, inner=8):
    """ms per call: median over reps of `inner` back-to-back calls between two events (the host
    queues them faster than the GPU runs them, so host overhead stays out of short kernels)."""
    for _ in range(3):
        f()
    st, en = cupy.cuda.Event(), cupy.cuda.Event()
    ts = []
    for _ in range(reps):
        st.record()
        for _ in range(inner):
            f()
        en.record()
        en.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(st, en) / inner)
    return float(np.median(ts))


def bench():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for d in (128, 64):
        h = 2048 // d
        for n in (512, 2048, 8192, 16384):
            b = max(1, 16384 // n)
            for causal in (False, True):
                rng = np.random.default_rng(1)
                q, k, v = testing.random_qkv(rng, b, n, n, h, d, testing.bf16())
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                res = {"d": d, "n": n, "b": b, "causal": causal}
                res["sm80"] = flops / timeit(lambda: fwd_sm80(q, k, v, causal=causal)) / 1e9
                for cfg in CFGS[d]:
                    try:
                        res[str(cfg)] = flops / timeit(lambda: run(cfg, q, k, v, causal)) / 1e9
                    except Exception as e:  # noqa: BLE001
                        res[str(cfg)] = repr(e)[:80]
                tq, tk, tv = (torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16).transpose(1, 2) for x in (q, k, v))
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    with sdpa_kernel([be]):
                        f = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                        try:
                            res[name] = flops / timeit(f) / 1e9
                        except Exception as e:  # noqa: BLE001
                            res[name] = repr(e)[:80]
                rows.append(res)
                print(json.dumps({k2: (round(v2, 1) if isinstance(v2, float) else v2) for k2, v2 in res.items()}), flush=True)
    return rows


if __name__ == "__main__":
    what = sys.argv[1:] or ["check"]
    if "check" in what:
        check()
    if "bench" in what:
        bench()


# ----------------------------------------------------------------------------- backward bring-up
def run_bwd(cfg, dout, q, k, v, out, lse, causal):
    """(dq, dk, dv) of the backward plan with the sm90 dK/dV tile `cfg` (Sm90BwdConfig fields:
    head_dim, block_q, consumers, stages, dq_bulk, overlap) between the sm80 prep and convert kernels."""
    from cuflash import _backward
    from cuflash.signature import BWD_ARRAYS
    from cuflash.tiles import Sm90BwdConfig

    tile = Sm90BwdConfig(*cfg)
    arrays = (dout, q, k, v, out, lse)

    def build():
        infos = [problem.describe(x, n) for x, n in zip(arrays, BWD_ARRAYS)]
        p = problem.resolve_backward(*infos, MaskOptions.of(causal=causal), None, False, None)
        return _backward._plan(p, _backward._tile(_backward._main_family(p, tile, None), tile, p), None, q.dtype)

    return _plan(("bwd", tile, _arrays_key(*arrays), causal), build).run(arrays)


BWD_CFGS = {d: [(d, 64, 2, 2, b, o) for o in (0, 1) for b in (0, 1, 2, 4)] for d in (128, 64)}
# SM90_BWD_CFG="128,64,2,2,1,0" runs one tile alone (scripts/gpu_run.sh runs each under its own
# timeout: on 2026-11-30 the run printed nothing for 180 s after the first tile, which looked like
# a hang of the dq_bulk tile, never seen alone); several tiles of one head dim separated by ";" run
# in one process (an A/B: "256,64,2,2,0,0;256,64,2,2,4,0")
if os.environ.get("SM90_BWD_CFG"):
    _tiles = [tuple(int(x) for x in c.split(",")) for c in os.environ["SM90_BWD_CFG"].split(";")]
    BWD_CFGS = {_tiles[0][0]: _tiles}


def check_bwd():
    from cuflash._backward import backward as bwd_sm80

    rng = np.random.default_rng(3)
    shapes = [(1, 128, 128, 2, False), (1, 64, 64, 1, False), (2, 257, 391, 2, False), (1, 300, 17, 2, True),
              (1, 17, 300, 2, True), (1, 1000, 1000, 2, True), (2, 333, 555, 3, False)]
    fails = 0
    for d, cfgs in BWD_CFGS.items():
        for cfg in cfgs:
            for dtname in ("bfloat16", "float16"):
                dt = testing.dtype_of(dtname)
                for (b, nq, nk, h, causal) in shapes:
                    q, k, v = testing.random_qkv(rng, b, nq, nk, h, d, dt)
                    dout = testing.random_qkv(rng, b, nq, nq, h, d, dt)[0]
                    out, lse = fwd_sm80(q, k, v, causal=causal)
                    try:
                        g9 = run_bwd(cfg, dout, q, k, v, out, lse, causal)
                        cupy.cuda.Device().synchronize()
                    except Exception as e:  # noqa: BLE001
                        print(f"FAIL cfg={cfg} {dtname} {b}x{nq}x{nk}x{h} causal={causal}: {e!r}"[:300], flush=True)
                        fails += 1
                        continue
                    g8 = bwd_sm80(dout, q, k, v, out, lse, causal=causal)
                    rule = testing.fa_rule_grads(g9, q, k, v, dout, causal, 1 / math.sqrt(d))
                    diffs = {n: float(cupy.abs(a.astype(cupy.float32) - b_.astype(cupy.float32)).max())
                             for n, a, b_ in zip(("dq", "dk", "dv"), g9, g8)}
                    ok = all(err <= allowed for err, _, allowed in rule.values())
                    fails += not ok
                    if not ok or (b, nq) == (1, 1000):
                        print(f"{'ok  ' if ok else 'FAIL'} cfg={cfg} {dtname} {b}x{nq}x{nk}x{h} causal={causal}: "
                              + " ".join(f"{n} err {e:.2e}/{al:.2e}" for n, (e, _, al) in rule.items())
                              + " |sm90-sm80| " + " ".join(f"{n} {x:.2e}" for n, x in diffs.items()), flush=True)
    print("BWD FAILS", fails)


def bench_bwd():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from cuflash._backward import backward as bwd_sm80

    for d in BWD_CFGS:
        h = 2048 // d
        # SM90_BWD_SEQLENS / SM90_BWD_CAUSAL ("0", "1" or "0,1") narrow the cells; SM90_BWD_NO_SM80=1 skips
        # the sm80 kernel (an A/B of sm90 sources needs only the tile and cuDNN)
        for n in [int(x) for x in os.environ.get("SM90_BWD_SEQLENS", "2048,8192").split(",")]:
            b = max(1, 16384 // n)
            for causal in [x == "1" for x in os.environ.get("SM90_BWD_CAUSAL", "0,1").split(",")]:
                rng = np.random.default_rng(1)
                q, k, v = testing.random_qkv(rng, b, n, n, h, d, testing.bf16())
                dout = testing.random_qkv(rng, b, n, n, h, d, testing.bf16())[0]
                out, lse = fwd_sm80(q, k, v, causal=causal)
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                res = {"d": d, "n": n, "causal": causal}
                if os.environ.get("SM90_BWD_NO_SM80") != "1":
                    res["sm80"] = flops / timeit(lambda: bwd_sm80(dout, q, k, v, out, lse, causal=causal)) / 1e9
                for cfg in BWD_CFGS[d]:
                    res[str(cfg)] = flops / timeit(lambda: run_bwd(cfg, dout, q, k, v, out, lse, causal)) / 1e9
                tq, tk, tv = (torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16).transpose(1, 2).detach().requires_grad_()
                              for x in (q, k, v))
                tdo = torch.from_dlpack(dout.view(cupy.int16)).view(torch.bfloat16).transpose(1, 2)
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    res["cudnn"] = flops / timeit(lambda: torch.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True)) / 1e9
                print(json.dumps({k2: (round(v2, 1) if isinstance(v2, float) else v2) for k2, v2 in res.items()}), flush=True)


if __name__ == "__main__" and ("bwd" in sys.argv[1:] or "benchbwd" in sys.argv[1:]):
    if "bwd" in sys.argv[1:]:
        check_bwd()
    if "benchbwd" in sys.argv[1:]:
        bench_bwd()
