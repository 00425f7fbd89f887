"""Calls with an empty dimension (batch, heads or a seqlen of 0) on the CPU: they validate like any
call, and their plan launches nothing (no device query, no compile); the outputs it promises are
checked here, what the GPU returns in tests/gpu/test_empty_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import _backward, _compile, _forward, _forward_v1, device, problem
from cuflash.launch import FilledPlan
from cuflash.problem import ArrayInfo


def info(shape, dtype="bfloat16"):
    it = 4 if dtype == "float32" else 2
    if 0 in shape:
        strides, ptr = (0,) * len(shape), 0  # what CuPy gives an empty array
    else:
        strides, acc = [], it
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
        ptr = 1 << 20
    return ArrayInfo(tuple(shape), dtype, it, tuple(strides), ptr, 0)


@pytest.fixture
def no_gpu(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("an empty call touched the device or the compiler")

    monkeypatch.setattr(device, "query", fail)
    monkeypatch.setattr(_compile, "get_kernel", fail)
    monkeypatch.setattr(_compile, "get_aux_kernel", fail)
    monkeypatch.setattr(problem, "describe", lambda x, name: x)
    monkeypatch.setattr(FilledPlan, "run", lambda self, args, dropout_args=None: self)  # the plan, not arrays
    for cache in (_forward._plans, _forward_v1._plans, _backward._plans):
        cache.clear()


def outputs(plan):
    return [(shape, value) for _, shape, _, value in plan._outputs]


CASES = [  # q shape, k/v shape
    ((0, 16, 2, 64), (0, 16, 2, 64)),
    ((2, 0, 2, 64), (2, 16, 2, 64)),
    ((2, 16, 2, 128), (2, 0, 2, 128)),
    ((2, 16, 0, 64), (2, 16, 0, 64)),
]


@pytest.mark.parametrize("qs,ks", CASES)
@pytest.mark.parametrize("fwd", [_forward.forward, _forward_v1.forward_v1])
def test_empty_forward_plans_fill(no_gpu, fwd, qs, ks):
    q, kv = info(qs), info(ks)
    plan = fwd(q, kv, kv, causal=True, dropout_p=0.1, seed=3)
    assert isinstance(plan, FilledPlan)
    b, nq, h, _ = qs
    assert outputs(plan) == [(qs, 0), ((b, h, nq), -np.inf)]


@pytest.mark.parametrize("qs,ks", CASES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_empty_backward_plans_zero_gradients(no_gpu, qs, ks, deterministic):
    q, kv = info(qs), info(ks)
    lse = info((qs[0], qs[2], qs[1]), "float32")
    plan = _backward.backward(q, q, kv, kv, q, lse, causal=True, deterministic=deterministic)
    assert isinstance(plan, FilledPlan)
    assert outputs(plan) == [(qs, 0), (ks, 0), (ks, 0)]


def test_empty_backward_still_checks_its_arguments(no_gpu):
    q, kv = info((2, 16, 2, 64)), info((2, 0, 2, 64))
    with pytest.raises(ValueError, match="lse must have shape"):
        _backward.backward(q, q, kv, kv, q, info((2, 2, 15), "float32"))
    with pytest.raises(TypeError, match="dout must have q's dtype"):
        _backward.backward(info((2, 16, 2, 64), "float16"), q, kv, kv, q, info((2, 2, 16), "float32"))
