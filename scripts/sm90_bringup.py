"""Bring-up harness for the sm90 forward kernel, independent of the library's dispatch: builds the
tensor maps itself (cuda-bindings), compiles the generated-style shell for sm_90a, checks outputs
against the float64 oracle (cuflash.testing.fa_rule) and times it next to the sm80 kernel and
PyTorch SDPA (flash, cuDNN) in the same run.

    python scripts/sm90_bringup.py check            # correctness matrix
    python scripts/sm90_bringup.py bench            # timing table
"""
from __future__ import annotations

import ctypes
import json
import math
import sys
import time

import numpy as np

sys.path.insert(0, ".")
import cupy  # noqa: E402

from cuflash import _compile, params, problem, testing  # noqa: E402
from cuflash._forward import forward as fwd_sm80  # noqa: E402
from cuflash.mask import MaskOptions  # noqa: E402

TMAP = np.dtype([("opaque", "<u8", (16,))])


_maps = {}


def encode(x, rows):
    key = (x.data.ptr, x.shape, x.strides, x.dtype.name, rows)
    if key not in _maps:
        _maps[key] = _encode(x, rows)
    return _maps[key]


def _encode(x, rows):
    from cuda.bindings import driver as cu

    b, s, h, d = x.shape
    e = x.dtype.itemsize
    sb, sn, sh, sd = (st // e for st in x.strides)
    assert sd == 1
    dt = (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if x.dtype.name == "bfloat16"
          else cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
    dims = [64, s, d // 64, h, b]
    strides = [sn * e, 128, sh * e, sb * e]
    box = [64, rows, d // 64, 1, 1]
    err, tm = cu.cuTensorMapEncodeTiled(dt, 5, x.data.ptr, [cu.cuuint64_t(v) for v in dims],
                                        [cu.cuuint64_t(v) for v in strides], [cu.cuuint32_t(v) for v in box],
                                        [cu.cuuint32_t(1)] * 5, cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                                        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                                        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    assert int(err) == 0, err
    raw = ctypes.string_at(int(tm.getPtr()), 128)
    return np.frombuffer(raw, dtype=TMAP).copy()


_mods = {}


def kernel(bf16, d, bc, c, s, pp, ov, drop):
    key = (bf16, d, bc, c, s, pp, ov, drop)
    if key in _mods:
        return _mods[key]
    fields = params.fields("FwdParams")
    scalars = ", ".join(f"{ct} {f}_" for f, ct in fields)
    gather = " ".join(f"p.{f} = {f}_;" for f, _ in fields)
    thr = (c + 1) * 128
    tf = lambda x: "true" if x else "false"
    src = (f'#include "flash_fwd_sm90.cuh"\n'
           f'extern "C" __global__ void __launch_bounds__({thr}, 1) kern(const __grid_constant__ cuflash::TmaMap tq, '
           f'const __grid_constant__ cuflash::TmaMap tk, const __grid_constant__ cuflash::TmaMap tv, '
           f'cuflash::elem_t* __restrict__ out, float* __restrict__ lse, {scalars}) {{\n'
           f' cuflash::FwdParams p; {gather}\n cuflash::flash_fwd_sm90<{tf(bf16)}, {d}, {bc}, {c}, {s}, {pp}, {ov}, '
           f'cuflash::Variant<{tf(drop)}, false>>(tq, tk, tv, out, lse, p);\n}}\n')
    mod = cupy.RawModule(code=src, options=_compile.nvrtc_options(("--gpu-architecture=sm_90a",)), backend="nvrtc")
    fn = mod.get_function("kern")
    smem = 2 * d * (64 * c + 2 * s * bc) + 1024
    fn.max_dynamic_shared_size_bytes = smem
    _mods[key] = (fn, smem)
    return fn, smem


def run(cfg, q, k, v, causal, scale=None, dropout_p=0.0, seed=0, out=None, lse=None):
    d, bc, c, s, pp, ov = cfg[:6]
    persistent = len(cfg) > 6 and cfg[6]
    bf16 = q.dtype.name == "bfloat16"
    drop = problem.resolve_dropout(dropout_p, seed) if dropout_p else None
    p = problem.resolve_forward(*(problem.describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))), MaskOptions.of(causal=causal), scale,
                                drop)
    br = 64 * c
    m_blocks = -(-p.seqlen_q // br)
    packed = params.pack_fwd(p, m_blocks)
    kp = params.KernelParams(packed)
    args = kp.arg if drop is None else kp.with_dropout(drop.kernel_args)
    fn, smem = kernel(bf16, d, bc, c, s, pp, ov, drop is not None)
    if persistent == 2:  # check-only: a grid much smaller than the tile count (many tiles per CTA)
        persistent = 3
    b, nq, h, _ = q.shape
    if out is None:
        out = cupy.empty_like(q)
    if lse is None:
        lse = cupy.empty((b, h, nq), cupy.float32)
    maps = (encode(q, br), encode(k, bc), encode(v, bc))
    tiles = m_blocks * h * b
    grid = (min(tiles, 3) if persistent == 3 else min(tiles, cupy.cuda.Device().attributes["MultiProcessorCount"])
            if persistent else tiles)
    fn((grid,), ((c + 1) * 128,), (*maps, out, lse, *args), shared_mem=smem)
    return out, lse


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
_bwd_mods = {}


def bwd_kernel(bf16, d, br, c, s, dqb=0):
    key = (bf16, d, br, c, s, dqb)
    if key in _bwd_mods:
        return _bwd_mods[key]
    fields = params.fields("BwdParams")
    scalars = ", ".join(f"{ct} {f}_" for f, ct in fields)
    gather = " ".join(f"p.{f} = {f}_;" for f, _ in fields)
    tf = lambda x: "true" if x else "false"
    M = "const __grid_constant__ cuflash::TmaMap"
    src = (f'#include "flash_bwd_sm90.cuh"\n'
           f'extern "C" __global__ void __launch_bounds__({(c + 1) * 128}, 1) kern({M} tq, {M} tk, {M} tv, {M} tdo, '
           f'const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc, '
           f'cuflash::elem_t* __restrict__ dk, cuflash::elem_t* __restrict__ dv, {scalars}) {{\n'
           f' cuflash::BwdParams p; {gather}\n cuflash::flash_bwd_sm90<{tf(bf16)}, {d}, {br}, {c}, {s}, {dqb}, '
           f'cuflash::Variant<false, false>>(tq, tk, tv, tdo, lse2, delta, dq_acc, dk, dv, p);\n}}\n')
    mod = cupy.RawModule(code=src, options=_compile.nvrtc_options(("--gpu-architecture=sm_90a",)), backend="nvrtc")
    fn = mod.get_function("kern")
    smem = 2 * (64 * c) * d * 2 + 2 * s * br * d * 2 + 2 * (64 * c) * br * 2 + (d // 64) * 64 * 272 * dqb + 1024  # kSmemBytes
    fn.max_dynamic_shared_size_bytes = smem
    _bwd_mods[key] = (fn, smem)
    return fn, smem


def run_bwd(cfg, dout, q, k, v, out, lse, causal):
    """(dq, dk, dv) with the sm90 dK/dV kernel between the sm80 backward's prep and convert kernels."""
    from cuflash import _backward
    from cuflash.launch import Buffer, Launch, Plan
    from cuflash.signature import BWD_ARRAYS

    d, br, c, s, *rest = cfg
    dqb = rest[0] if rest else 0
    bc = 64 * c
    infos = [problem.describe(x, n) for x, n in zip((dout, q, k, v, out, lse), BWD_ARRAYS)]
    p = problem.resolve_backward(*infos, MaskOptions.of(causal=causal), None, False, None)
    b, nq, nk, h = p.batch, p.seqlen_q, p.seqlen_k, p.heads
    pad = -(-nq // 128) * 128
    ws_rows = b * h * pad
    chunks = d // 8
    prep = _compile.get_aux_kernel("bwd_prep", p.features, p.device)
    conv = _compile.get_aux_kernel("bwd_dq_convert", p.features, p.device)
    fn, smem = bwd_kernel(q.dtype.name == "bfloat16", d, br, c, s, dqb)
    n_blocks = -(-nk // bc)

    def bind(slots):
        dout_, q_, k_, v_ = slots[:4]
        return (encode(q_, br), encode(k_, bc), encode(v_, bc), encode(dout_, br), *slots[4:])

    launches = (
        Launch(prep, (-(-ws_rows * chunks // 256),), (256,), 0, pointers=("out", "dout", "lse", "delta", "lse2", "dq_acc")),
        Launch(fn, (n_blocks * h * b,), ((c + 1) * 128,), smem,
               pointers=("dout", "q", "k", "v", "lse2", "delta", "dq_acc", "dk", "dv"), bind=bind),
        Launch(conv, (-(-b * h * nq * chunks // 256),), (256,), 0, pointers=("dq_acc", "dq")),
    )
    buffers = (Buffer("dq", (b, nq, h, d), q.dtype), Buffer("dk", (b, nk, h, d), q.dtype),
               Buffer("dv", (b, nk, h, d), q.dtype), Buffer("delta", (ws_rows,)), Buffer("lse2", (ws_rows,)),
               Buffer("dq_acc", (ws_rows * d,)))
    plan = Plan(p.device, BWD_ARRAYS, buffers, launches, ("dq", "dk", "dv"), params.pack_bwd(p, pad, n_blocks, 0))
    return plan.run((dout, q, k, v, out, lse))


BWD_CFGS = {128: [(128, 64, 2, 2, 0), (128, 64, 2, 2, 1)], 64: [(64, 64, 2, 2, 0), (64, 64, 2, 2, 1)]}


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

    for d in (128, 64):
        h = 2048 // d
        for n in (2048, 8192):
            b = max(1, 16384 // n)
            for causal in (False, True):
                rng = np.random.default_rng(1)
                q, k, v = testing.random_qkv(rng, b, n, n, h, d, testing.bf16())
                dout = testing.random_qkv(rng, b, n, n, h, d, testing.bf16())[0]
                out, lse = fwd_sm80(q, k, v, causal=causal)
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                res = {"d": d, "n": n, "causal": causal}
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
