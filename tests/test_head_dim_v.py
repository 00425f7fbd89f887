"""A value head dim of its own (issue 12; MLA's 192 / 128): v (and out, dout, dv) may have another head
dim than q and k. The checks, the problem's instance and parameters, the plans' buffers and the
float64 references, without a GPU (tests/gpu/test_head_dim_v_gpu.py runs the kernels)."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import _backward, _forward, families, launch, params, reference
from cuflash.mask import MaskOptions
from cuflash.problem import ArrayInfo, resolve_backward, resolve_forward
from cuflash.tiles import BwdConfig, FwdConfig

B, NQ, NK, H, HKV = 2, 40, 70, 4, 2


def info(shape, dtype="bfloat16", ptr=1 << 20):
    itemsize = 4 if dtype == "float32" else 2
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return ArrayInfo(tuple(shape), dtype, itemsize, tuple(strides), ptr, 0)


def fwd(d, dv, causal=False, hkv=HKV):
    return resolve_forward(info((B, NQ, H, d)), info((B, NK, hkv, d)), info((B, NK, hkv, dv)),
                           MaskOptions.of(causal=causal), None)


@pytest.mark.parametrize("d,dv,inst", [(192, 128, 192), (128, 64, 128), (64, 128, 128), (96, 64, 96), (40, 32, 64)])
def test_the_instance_is_the_larger_head_dim_masked_to_each(d, dv, inst):
    p = fwd(d, dv)
    assert (p.head_dim, p.dv, p.head_dim_v) == (d, dv, dv)
    f = p.features
    assert f.head_dim == inst and f.partial_d
    assert p.softmax_scale == pytest.approx(d ** -0.5)  # the default scale is q.k's
    a = params.pack_fwd(p, 1)[0]
    assert (a["head_dim"], a["head_dim_v"]) == (d, dv)
    assert (a["o_sb"], a["o_sn"], a["o_sh"]) == (NQ * H * dv, H * dv, dv)  # out has v's head dim


def test_equal_head_dims_are_the_plain_problem():
    p = fwd(128, 128)
    assert p.head_dim_v == 0 and p.dv == 128 and not p.features.partial_d
    assert params.pack_fwd(p, 1)[0]["head_dim_v"] == 128


@pytest.mark.parametrize("bad_k, words", [((B, NK, HKV, 64), "head_dim differs"),
                                           ((B, NK + 1, HKV, 192), r"same \(batch, seqlen, heads\)")])
def test_k_must_match_q_and_v_must_match_k_but_its_head_dim(bad_k, words):
    with pytest.raises(ValueError, match=words):
        resolve_forward(info((B, NQ, H, 192)), info(bad_k), info((B, NK, HKV, 128)), MaskOptions.of(), None)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        resolve_forward(info((B, NQ, H, 192)), info((B, NK, HKV, 192)), info((B, NK, HKV, 100)), MaskOptions.of(), None)


def test_backward_wants_out_and_dout_with_vs_head_dim():
    q, k, v = info((B, NQ, H, 192)), info((B, NK, HKV, 192)), info((B, NK, HKV, 128))
    o, lse = info((B, NQ, H, 128)), info((B, H, NQ), "float32", ptr=1 << 21)
    p = resolve_backward(o, q, k, v, o, lse, MaskOptions.of(causal=True), None)
    assert p.dv == 128 and p.strides["out"] == (NQ * H * 128, H * 128, 128)
    for bad in ("out", "dout"):
        arrays = dict(dout=o, out=o)
        arrays[bad] = info((B, NQ, H, 192))
        with pytest.raises(ValueError, match=f"{bad} must have q's shape with v's head dim"):
            resolve_backward(arrays["dout"], q, k, v, arrays["out"], lse, MaskOptions.of(), None)
    a = params.pack_bwd(p, 64, 3)[0]
    assert (a["head_dim"], a["head_dim_v"]) == (192, 128)
    assert (a["dk_sh"], a["dv_sh"]) == (192, 128) and a["dv_sn"] == H * 128  # GQA: the expanded buffers


def test_plans_allocate_out_and_dv_with_vs_head_dim(monkeypatch):
    """The forward's out and the backward's dv (and its GQA expansion) have v's head dim; dq, dk q's."""
    cupy = pytest.importorskip("cupy")
    import contextlib

    from cuflash import _compile

    class Rec:
        def __call__(self, grid, block, args, shared_mem=0):
            pass

    monkeypatch.setattr(_compile, "get_kernel", lambda cfg, f, dev: Rec())
    monkeypatch.setattr(_compile, "get_aux_kernel", lambda name, f, dev: Rec())
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: ("alloc", tuple(shape), np.dtype(dtype).name))
    monkeypatch.setattr(launch, "_capturing", lambda: False)  # no GPU: no capture
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: contextlib.nullcontext())
    p = fwd(192, 128)
    out, lse = _forward._plan(p, FwdConfig(192, 64, 64, 4, 2), np.float16).run(("q", "k", "v", None, None))
    assert out == ("alloc", (B, NQ, H, 128), "float16") and lse == ("alloc", (B, H, NQ), "float32")
    pb = resolve_backward(info((B, NQ, H, 128)), info((B, NQ, H, 192)), info((B, NK, HKV, 192)),
                          info((B, NK, HKV, 128)), info((B, NQ, H, 128)), info((B, H, NQ), "float32", ptr=1 << 21),
                          MaskOptions.of(), None)
    plan = _backward._plan(pb, BwdConfig(192, 64, 128, 8, 2), None, np.float16)
    dq, dk, dv = plan.run(("do", "q", "k", "v", "o", "lse"))
    assert dq == ("alloc", (B, NQ, H, 192), "float16") and dk == ("alloc", (B, NK, HKV, 192), "float16")
    assert dv == ("alloc", (B, NK, HKV, 128), "float16")


def test_the_hopper_backward_and_v1_refuse_it_and_say_why():
    import pathlib

    from cuflash.device import DeviceProps

    props = DeviceProps.from_json(pathlib.Path(__file__).parent / "fixtures" / "devices" / "h200.json")
    p = fwd(128, 64)
    assert "value head dim other than q's (v 64, q and k 128)" in families.BWD_SM90.cannot_run(p, props)
    assert families.FWD.cannot_run(p, props) is None
    assert "v1 forward has no value head dim" in families.FWD_V1.cannot_run(p, props)


def test_the_hopper_forward_takes_it(monkeypatch):
    """The sm90 forward runs a value head dim through its rank-4 TMA maps (v's map has d_v
    columns), forced or by the automatic choice."""
    import pathlib

    from cuflash import device, tma
    from cuflash.device import DeviceProps

    props = DeviceProps.from_json(pathlib.Path(__file__).parent / "fixtures" / "devices" / "h200.json")
    monkeypatch.setattr(tma, "bindings_problem", lambda: None)  # (cuda-bindings may be absent on a CPU host)
    monkeypatch.setattr(device, "query", lambda device_id=0: props)
    p = fwd(192, 128)
    assert families.FWD_SM90.cannot_run(p, props) is None
    assert families.choose(families.FORWARDS, p, "sm90", props) is families.FWD_SM90
    assert families.choose(families.FORWARDS, p, None, props) is families.FWD_SM90
    shape, strides = tma.tensor_layout(p, "v")
    assert shape[-1] == 128 and tma.tensor_layout(p, "k")[0][-1] == 192
    g = tma.map_geometry(shape, strides, "bfloat16", 112, partial=True)
    assert g.dims == (128, NK, HKV, B) and g.box == (64, 112, 1, 1)


@pytest.mark.parametrize("d,dv,causal,hkv", [(24, 16, False, 2), (16, 24, True, 1), (32, 8, True, 4)])
def test_references_agree_with_the_definition(d, dv, causal, hkv):
    """out = softmax(scale q k^T) v with v's own width, by the naive and both tiled references, and
    the backward's gradients by finite differences of sum(out * dout)."""
    rng = np.random.default_rng(d * 100 + dv)
    q = rng.standard_normal((2, 9, 4, d))
    k = rng.standard_normal((2, 13, hkv, d))
    v = rng.standard_normal((2, 13, hkv, dv))
    out, lse = reference.attention_naive(q, k, v, causal=causal)
    assert out.shape == (2, 9, 4, dv)
    kk, vv = reference.repeat_kv(k, 4), reference.repeat_kv(v, 4)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
    allowed = reference.visible(9, 13, causal=causal)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", pr / pr.sum(-1, keepdims=True), vv)
    np.testing.assert_allclose(out, want, atol=1e-12)
    for tiled in (reference.attention_v1_tiled, reference.attention_v2_tiled):
        o2, l2 = tiled(q, k, v, causal=causal, block_q=4, block_k=5)
        np.testing.assert_allclose(o2, out, atol=1e-12)
        np.testing.assert_allclose(l2, lse, atol=1e-12)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv_ = reference.attention_backward(dout, q, k, v, out, lse, causal=causal)
    assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)
    f = lambda q_, k_, v_: float((reference.attention_naive(q_, k_, v_, causal=causal)[0] * dout).sum())  # noqa: E731
    eps = 1e-6
    for x, g, name in ((q, dq, "q"), (k, dk, "k"), (v, dv_, "v")):
        idx = tuple(rng.integers(0, n) for n in x.shape)
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        args_p = {"q": (xp, k, v), "k": (q, xp, v), "v": (q, k, xp)}[name]
        args_m = {"q": (xm, k, v), "k": (q, xm, v), "v": (q, k, xm)}[name]
        assert (f(*args_p) - f(*args_m)) / (2 * eps) == pytest.approx(g[idx], abs=1e-6), name
