"""Launch plans on CPU: the kernels' argument lists (order and NumPy types), allocations and the
launch sequence of each pass, with CuPy's allocation and the kernels replaced by recorders."""
import contextlib

import numpy as np
import pytest

from cuflash import _backward, _compile, _forward, _forward_v1, problem
from cuflash.tiles import BwdConfig, DqConfig, FwdConfig, V1Config

B, NQ, NK, H, D = 2, 100, 300, 3, 64


class Recorder:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((self.name, grid, block, args, shared_mem))


@pytest.fixture
def calls(monkeypatch):
    cupy = pytest.importorskip("cupy")
    rec = []
    monkeypatch.setattr(_compile, "get_kernel", lambda cfg, f, dev: Recorder(type(cfg).__name__, rec))
    monkeypatch.setattr(_compile, "get_aux_kernel", lambda name, f, dev: Recorder(name, rec))
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: ("alloc", tuple(shape), np.dtype(dtype).name))
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: contextlib.nullcontext())
    return rec


def info(shape, dtype="float16"):
    it = np.dtype(dtype).itemsize
    strides, acc = [], it
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return problem.ArrayInfo(shape, dtype, it, tuple(strides), 1 << 20, 0)


def fwd_problem(causal=True, dropout=None):
    return problem.resolve_forward(info((B, NQ, H, D)), info((B, NK, H, D)), info((B, NK, H, D)), causal, 0.5, dropout)


def kinds(args):
    return [a if isinstance(a, str) else type(a).__name__ for a in args]


def test_forward_arguments(calls):
    drop = problem.resolve_dropout(0.1, 5)
    out, lse = _forward._plan(fwd_problem(), FwdConfig(64, 128, 64, 4, 2), np.float16).run(
        ("q", "k", "v", None, None), drop.kernel_args)
    assert out == ("alloc", (B, NQ, H, D), "float16") and lse == ("alloc", (B, H, NQ), "float32")
    [(name, grid, block, args, smem)] = calls
    assert (name, grid, block, smem) == ("FwdConfig", (1 * H * B,), (128,), FwdConfig(64, 128, 64, 4, 2).smem_bytes)
    assert args[:5] == ("q", "k", "v", out, lse)
    assert kinds(args[5:]) == ["int64"] * 12 + ["int32"] * 4 + ["float32", "int32", "uint64", "uint32", "float32"]
    assert [int(x) for x in args[5:17]] == [NQ * H * D, H * D, D] + [NK * H * D, H * D, D] * 2 + [NQ * H * D, H * D, D]
    assert [int(x) for x in args[17:21]] == [H, NQ, NK, 1]
    assert args[21] == np.float32(0.5 * 1.4426950408889634) and int(args[22]) == 1
    assert args[23:] == drop.kernel_args


def test_forward_v1_workspaces_per_call(calls):
    cfg = V1Config(64, 64, 64, 4, 2)
    plan = _forward_v1._plan(fwd_problem(causal=False), cfg, np.float16)
    plan.run(("q", "k", "v", "out", "lse"), problem.NO_DROPOUT_ARGS)
    [(name, grid, _, args, _)] = calls
    rows = B * H * NQ
    assert name == "V1Config" and grid == (B * H,)
    assert args[:7] == ("q", "k", "v", "out", "lse", ("alloc", (rows * D,), "float32"), ("alloc", (rows * 2,), "float32"))
    assert int(args[7 + 12 + 4 + 1]) == 0  # not causal
    assert args[-3:] == problem.NO_DROPOUT_ARGS


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_launch_sequence(calls, deterministic):
    arrays = {n: info(s) for n, s in (("dout", (B, NQ, H, D)), ("q", (B, NQ, H, D)), ("k", (B, NK, H, D)),
                                      ("v", (B, NK, H, D)), ("out", (B, NQ, H, D)))}
    lse = info((B, H, NQ), "float32")
    p = problem.resolve_backward(arrays["dout"], arrays["q"], arrays["k"], arrays["v"], arrays["out"], lse, True,
                                 None, deterministic)
    dq_cfg = DqConfig(64, 64, 64, 4, 2) if deterministic else None
    dq, dk, dv = _backward._plan(p, BwdConfig(64, 64, 64, 4, 2), dq_cfg, np.float16).run(
        ("dout", "q", "k", "v", "out", "lse"), problem.NO_DROPOUT_ARGS)
    pad = 128  # seqlen_q rounded up to _ROW_PAD
    delta = lse2 = ("alloc", (B * H * pad,), "float32")
    dq_acc = np.uint64(0) if deterministic else ("alloc", (B * H * pad * D,), "float32")
    names = [c[0] for c in calls]
    assert names == ["bwd_prep", "BwdConfig", "DqConfig" if deterministic else "bwd_dq_convert"]
    prep, main, post = (c[3] for c in calls)
    assert prep[:6] == ("out", "dout", "lse", delta, lse2, dq_acc) and len(prep) == 6 + 10
    assert main[:9] == ("q", "k", "v", "dout", lse2, delta, dq_acc, dk, dv)
    assert kinds(main[9:]) == ["int64"] * 18 + ["int32"] * 5 + ["float32", "float32", "int32"] + [
        "uint64", "uint32", "float32"]
    if deterministic:
        assert post[:7] == ("q", "k", "v", "dout", lse2, delta, dq) and len(post) == 7 + 15 + 5 + 3 + 3
    else:
        assert post[:2] == (dq_acc, dq) and kinds(post[2:]) == ["int64"] * 3 + ["int32"] * 3 + ["float32", "int64"]
